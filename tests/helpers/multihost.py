"""A job across hosts on one machine: three worker hosts of two ranks and a spare host of
two hot spares, each host a network namespace (:mod:`torchrelay.netns`) running one
``torchrelay run`` launcher, the control plane on the bridge. The multi-host e2e tests and
``python -m tests.bench multihost`` share it."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.harness import Stack, run_command, start_stack, stop_stack, wait_until
from torchrelay import netns

WORKER_HOSTS = ["h0", "h1", "h2"]
SPARE_HOST = "hs"
PER_HOST = 2
STEPS = 70
STEP_SLEEP = "0.05"
SCRIPT_ARGS = ["--step-sleep", STEP_SLEEP]
CHAOS = [sys.executable, "-m", "torchrelay.cli", "chaos"]
CLAIM = "multihost-test-claim-0123456789"


@dataclass
class Cluster:
    """The hosts' network and the stack that listens on its bridge."""

    net: netns.Network
    stack: Stack
    logs: Path


@dataclass
class Job:
    job_id: str
    out: Path
    launchers: dict[str, subprocess.Popen[bytes]]
    logs: Path

    def log(self, host: str) -> str:
        return netns.read_log(self.logs / f"{self.job_id}-{host}.log")

    def all_logs(self) -> str:
        return "\n".join(f"== {h}\n{self.log(h)}" for h in self.launchers)


def _launcher_env(cluster: Cluster) -> dict[str, str]:
    return cluster.stack.env(
        TORCHRELAY_JOB_CLAIM=CLAIM,
        TORCHRELAY_NATS_CREDENTIALS=str(cluster.stack.info["credentials"]["launcher"]),
    )


def start_job(
    cluster: Cluster,
    job_id: str,
    spares: bool = True,
    steps: int = STEPS,
    hosts: list[str] | None = None,
    nnodes: int | None = None,
) -> Job:
    """One launcher per worker host (and the spare host's), each in its own namespace.

    ``hosts`` and ``nnodes`` given: those hosts join as workers of an ``nnodes``-host job
    without a node rank (the rendezvous picks one, or refuses them)."""
    out = cluster.logs / job_id
    out.mkdir(exist_ok=True)
    env = _launcher_env(cluster)
    job = Job(job_id, out, {}, cluster.logs)
    per_node = ["--nproc-per-node", str(PER_HOST)]
    chosen = hosts or ([*WORKER_HOSTS, SPARE_HOST] if spares else WORKER_HOSTS)
    for rank, host in enumerate(chosen):
        plan = (
            ["--spare", *per_node]
            if host == SPARE_HOST and hosts is None
            else ["--nnodes", str(nnodes or len(WORKER_HOSTS)), *per_node]
            + ([] if hosts is not None else ["--node-rank", str(rank)])
        )
        plan += ["--node-name", host, "--simulate-gpus"]
        log = (cluster.logs / f"{job_id}-{host}.log").open("ab")
        job.launchers[host] = cluster.net.spawn(
            host, run_command(job_id, plan, steps, out, SCRIPT_ARGS), env, log
        )
    return job


def start_one_host_job(cluster: Cluster, job_id: str, spares: int, steps: int = STEPS) -> Job:
    """The same ranks and spares as children of one launcher on the machine itself (the
    one-host shortcut), against the same stack: the baseline of the hosts' figures."""
    out = cluster.logs / job_id
    out.mkdir()
    world = len(WORKER_HOSTS) * PER_HOST
    plan = ["--nproc", str(world), "--spares", str(spares), "--nodes", str(len(WORKER_HOSTS))]
    log = (cluster.logs / f"{job_id}-local.log").open("ab")
    proc = subprocess.Popen(
        run_command(job_id, plan, steps, out, SCRIPT_ARGS),
        env=_launcher_env(cluster),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return Job(job_id, out, {"local": proc}, cluster.logs)


def api_get(stack: Stack, path: str, **params: Any) -> Any:
    with stack.api() as api:
        resp = api.get(path, params=params)
        return resp.json() if resp.status_code == 200 else None


def committed(stack: Stack, job_id: str) -> int:
    info = api_get(stack, f"/v1/jobs/{job_id}")
    return int((info or {}).get("committed_step") or -1)


def incidents(stack: Stack, job_id: str) -> list[dict[str, Any]]:
    got = api_get(stack, "/v1/incidents", job_id=job_id, limit=100)
    return list((got or {}).get("items") or [])


def closed(stack: Stack, job_id: str, count: int) -> list[dict[str, Any]] | None:
    items = incidents(stack, job_id)
    done = [i for i in items if i["resolution"] != "open"]
    return done if len(done) >= count and len(done) == len(items) else None


def wait_launchers(job: Job, hosts: list[str], timeout: float = 300) -> None:
    for host in hosts:
        try:
            rc = job.launchers[host].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"launcher of {host} still running after {timeout:.0f}s\n{job.all_logs()}"
            ) from None
        assert rc == 0, f"launcher of {host} exited {rc}\n{job.all_logs()}"


@contextlib.contextmanager
def cluster_at(logs: Path) -> Iterator[Cluster]:
    """The four hosts and a stack on their bridge; everything stopped and removed after."""
    with netns.network([*WORKER_HOSTS, SPARE_HOST]) as net:
        stack = start_stack(logs / "stack", {"TORCHRELAY_BIND": net.gateway})
        try:
            if net.gateway not in stack.plain_nats_url:
                raise RuntimeError(f"the stack does not listen on the bridge: {stack.info}")
            yield Cluster(net, stack, logs)
        finally:
            stop_stack(stack)


def start_at_step(cluster: Cluster, job_id: str, step: int, **kwargs: Any) -> Job:
    """:func:`start_job`, returned once the job has committed ``step`` (a fault's moment)."""
    job = start_job(cluster, job_id, **kwargs)
    wait_until(lambda: committed(cluster.stack, job_id) >= step, 240, f"step {step} of {job_id}")
    return job


def chaos(stack: Stack, *args: str) -> None:
    """``torchrelay chaos ARGS`` against the stack; fails naming its error."""
    done = subprocess.run(
        [*CHAOS, *args], env=stack.env(), capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise AssertionError(f"torchrelay chaos {' '.join(args)}: {done.stderr}")
