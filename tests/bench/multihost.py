"""Multi-host bench: the stall of a fault across hosts beside the same fault on one host.

The job: 6 data-parallel gloo ranks of the example MLP (hidden 256), ``STEPS`` steps, against
one stack. Three arms, each ``TORCHRELAY_BENCH_FAULT_RUNS`` times (default 2):

- ``one_host_kill``: ``torchrelay run --nproc 6 --spares 2`` on the machine itself; rank 3
  SIGKILLed at step ``FAULT_AT`` (the one-host figure);
- ``hosts_kill``: 3 worker hosts of 2 ranks and a spare host of 2 spares, each host a network
  namespace on a bridge with the stack listening on it (:mod:`tests.helpers.multihost`); the
  same SIGKILL of rank 3 (on host h1), whose rank moves to the spare host;
- ``host_loss``: the same hosts; every process of h1, its launcher and node agent included,
  SIGKILLed at once; its two ranks move to the spare host.

Figures per arm, from the control plane's incidents: ``stall_s`` (an incident's
``stall_ms``: the survivors' longest step gap around the migration; the largest of a run's
incidents; the median over the runs, each run's in ``stall_runs_s``), ``lost_steps`` (the
most of any incident), ``equal_final`` (every rank's final state equal to the fault-free run
of the same layout, in every run). ``ratios`` divide each arm's stall by ``one_host_kill``'s.
Without network namespaces (not root, no ``ip``) it reports why and measures nothing.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.harness import digests, wait_until
from tests.helpers.multihost import (
    PER_HOST,
    SPARE_HOST,
    WORKER_HOSTS,
    Cluster,
    Job,
    chaos,
    closed,
    cluster_at,
    committed,
    start_job,
    start_one_host_job,
    wait_launchers,
)
from torchrelay import netns

STEPS = 80
FAULT_AT = 20
VICTIM_RANK = 3  # on host h1 across hosts
LOST_HOST = "h1"
RUNS_ENV = "TORCHRELAY_BENCH_FAULT_RUNS"
ARMS = ("one_host_kill", "hosts_kill", "host_loss")


def _runs() -> int:
    raw = os.environ.get(RUNS_ENV, "2")
    try:
        runs = int(raw)
    except ValueError:
        raise ValueError(f"{RUNS_ENV}={raw!r}: give a whole number of runs, e.g. 2") from None
    if runs < 1:
        raise ValueError(f"{RUNS_ENV}={raw!r}: at least 1 run")
    return runs


def _start(cluster: Cluster, arm: str, job_id: str, fault: bool) -> Job:
    if arm == "one_host_kill":
        return start_one_host_job(cluster, job_id, spares=2 if fault else 0, steps=STEPS)
    return start_job(cluster, job_id, spares=fault, steps=STEPS)


def _finish(job: Job, lost_host: str | None = None) -> None:
    wait_launchers(job, [h for h in job.launchers if h != lost_host], timeout=300)


def _reference(cluster: Cluster, arm: str) -> dict[int, str]:
    job = _start(cluster, arm, f"mhb-ref-{arm}", fault=False)
    _finish(job)
    ref = digests(job.out)
    if sorted(ref) != list(range(len(WORKER_HOSTS) * PER_HOST)):
        raise RuntimeError(f"the reference run of {arm} wrote {sorted(ref)}\n{job.all_logs()}")
    return ref


def _one_run(cluster: Cluster, arm: str, index: int, ref: dict[int, str]) -> dict[str, Any]:
    stack = cluster.stack
    job = _start(cluster, arm, f"mhb-{arm}-{index}", fault=True)
    wait_until(lambda: committed(stack, job.job_id) >= FAULT_AT, 240, f"step {FAULT_AT}")
    t0 = time.monotonic()
    lost_host = None
    if arm == "host_loss":
        lost_host = LOST_HOST
        cluster.net.kill_host(LOST_HOST)
    else:
        chaos(cluster.stack, "kill", "--job", job.job_id, "--rank", str(VICTIM_RANK))
    expected = PER_HOST if arm == "host_loss" else 1
    found = wait_until(lambda: closed(stack, job.job_id, expected), 120, "the incidents")
    closed_s = time.monotonic() - t0
    _finish(job, lost_host)
    stalls = [i["stall_ms"] / 1000 for i in found if i.get("stall_ms") is not None]
    return {
        "stall_s": max(stalls) if stalls else None,
        "lost_steps": max(int(i.get("lost_steps") or 0) for i in found),
        "resolutions": sorted({str(i["resolution"]) for i in found}),
        "incidents": len(found),
        "closed_s": closed_s,
        "equal_final": digests(job.out) == ref,
    }


def run() -> dict[str, Any]:
    why = netns.unavailable()
    if why is not None:
        return {"skipped": why, "summary": f"skipped: no network namespaces here ({why})"}
    runs = _runs()
    arms: dict[str, dict[str, Any]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="tr-bench-hosts-") as tmp,
        cluster_at(Path(tmp)) as cluster,
    ):
        refs = {"one_host_kill": _reference(cluster, "one_host_kill")}
        refs["hosts"] = _reference(cluster, "hosts_kill")
        for arm in ARMS:
            ref = refs["one_host_kill" if arm == "one_host_kill" else "hosts"]
            results = [_one_run(cluster, arm, i, ref) for i in range(runs)]
            stalls = [r["stall_s"] for r in results if r["stall_s"] is not None]
            arms[arm] = {
                "stall_s": statistics.median(stalls) if stalls else None,
                "stall_runs_s": [r["stall_s"] for r in results],
                "lost_steps": max(r["lost_steps"] for r in results),
                "incidents_per_run": [r["incidents"] for r in results],
                "resolutions": sorted({x for r in results for x in r["resolutions"]}),
                "closed_runs_s": [round(r["closed_s"], 3) for r in results],
                "equal_final": all(r["equal_final"] for r in results),
            }
            print(f"multihost {arm}: {arms[arm]}", flush=True)
        same_state = refs["one_host_kill"] == refs["hosts"]
    base = arms["one_host_kill"]["stall_s"]
    ratios = {
        arm: (arms[arm]["stall_s"] / base if base and arms[arm]["stall_s"] else None)
        for arm in ARMS
    }
    stall = {arm: arms[arm]["stall_s"] for arm in ARMS}
    return {
        "layout": (
            f"{len(WORKER_HOSTS)} worker hosts x {PER_HOST} ranks + spare host {SPARE_HOST} x "
            f"{PER_HOST} (network namespaces) / one host: --nproc 6 --spares 2"
        ),
        "steps": STEPS,
        "fault_at_step": FAULT_AT,
        "runs": runs,
        "arms": arms,
        "ratios": ratios,
        "layouts_same_final_state": same_state,
        "summary": (
            "stall one host {:.3f} s, across hosts {:.3f} s, host loss {:.3f} s; "
            "equal_final {}".format(
                *(stall[a] if stall[a] is not None else float("nan") for a in ARMS),
                all(arms[a]["equal_final"] for a in ARMS),
            )
        ),
    }
