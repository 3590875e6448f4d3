"""Checkpoint bench: what asynchronous DCP checkpoints cost a step, and what a
``checkpoint_restart`` costs a job (docs/design.md §13).

1. Step time: a 4-rank gloo job of the agent bench's MLP (about 2.1M parameters, AdamW:
   state about 25 MB) runs ``STEPS`` steps without checkpoints and with one every
   ``EVERY`` steps (``--checkpoint-every``, local disk), in alternating runs (``RUNS`` of
   each, so both see the same machine). The figure is the mean step time after warm-up,
   checkpoint steps included (a median would hide them); target: with / without <= 1.02.
   On this 2-core machine two runs of the same job differ by more than that, so the cost
   is also measured inside each run with checkpoints: the extra time of the ``WINDOW``
   steps after each checkpoint over their median, less the same for windows half-way
   between checkpoints (``checkpoint_cost_ms``), and the ratio it implies
   (``step_time_ratio_within``).
2. Restart: the whole control plane (``torchrelay up``), a 3-rank job with no spare and
   ``--policy checkpoint_restart --checkpoint-every 10``; rank 1 is SIGKILLed in step 37's
   all-reduce. Figures: the incident's lost steps (7 expected), the time from the fault's
   detection to the restarted job's first committed step (``stall_ms`` on the incident),
   the launcher's wall time against a fault-free run's, and whether the final state equals
   the fault-free run's.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.bench import print_figures
from tests.bench.migration import RelayStack
from tests.helpers.relay import TRAIN_SCRIPT, FakeExecutor, LaunchedJob
from torchrelay.bus import Bus
from torchrelay.runtime import nats_server

REPO = Path(__file__).resolve().parents[2]
WORLD = 4
STEPS = 200
EVERY = 50
SKIP = 8
RUNS = 2
ENV = {
    "TR_STEPS": str(STEPS),
    "TR_WIDTH": "1024",
    "TR_DEPTH": "3",
    "TR_STEP_SLEEP_S": "0",
    "TORCHRELAY_VERIFY_EVERY": "0",
}
WINDOW = 6
RESTART_STEPS = 45
RESTART_KILL_STEP = 37


def mean_step(run_dir: Path) -> float:
    """Median over ranks of the mean gap between consecutive commits after warm-up."""
    means = []
    for path in sorted(run_dir.glob("*.digest.json")):
        times = json.loads(path.read_text())["commit_times"][SKIP:]
        means.append((times[-1] - times[0]) / (len(times) - 1))
    return statistics.median(means)


def window_cost(run_dir: Path) -> float:
    """Seconds a checkpoint adds: the excess over the median step of the ``WINDOW`` steps
    after each checkpoint, less that of windows half-way between (median over ranks)."""
    costs = []
    for path in sorted(run_dir.glob("*.digest.json")):
        times = json.loads(path.read_text())["commit_times"]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        typical = statistics.median(gaps[SKIP:])
        starts = range(EVERY, STEPS - WINDOW, EVERY)
        after = [_excess(gaps, k - 1, typical) for k in starts]
        between = [_excess(gaps, k - 1 + EVERY // 2, typical) for k in starts]
        costs.append(statistics.mean(after) - statistics.mean(between))
    return statistics.median(costs)


def _excess(gaps: list[float], start: int, typical: float) -> float:
    return sum(g - typical for g in gaps[start : start + WINDOW])


async def _step_time(
    bus: Bus, url: str, tmp: Path, index: int, ckpt: Path | None
) -> tuple[float, float]:
    job_id = f"bench-ckpt-{'on' if ckpt else 'off'}-{index}"
    env = dict(ENV)
    if ckpt is not None:
        env.update(TORCHRELAY_CHECKPOINT_DIR=str(ckpt), TORCHRELAY_CHECKPOINT_EVERY=str(EVERY))
    ex = await FakeExecutor(bus, job_id, WORLD).start()
    job = LaunchedJob(job_id, url, tmp, nproc=WORLD, spares=0, env=env)
    try:
        if await job.wait(600) != 0:
            raise RuntimeError(f"{job_id} failed:\n{job.output()[-3000:]}")
    finally:
        job.close()
        await ex.stop()
    return mean_step(job.run_dir), window_cost(job.run_dir) if ckpt is not None else 0.0


async def _step_times(tmp: Path) -> dict[str, Any]:
    server = nats_server(tmp / "nats")
    server.start()
    plain: list[float] = []
    with_ckpt: list[float] = []
    costs: list[float] = []
    sizes: list[int] = []
    try:
        bus = await Bus.connect(server.url, "bench-checkpoint")
        await bus.provision_streams()
        try:
            for i in range(RUNS):
                plain.append((await _step_time(bus, server.url, tmp, i, None))[0])
                ckpt = tmp / f"ckpt{i}"
                step, cost = await _step_time(bus, server.url, tmp, i, ckpt)
                with_ckpt.append(step)
                costs.append(cost)
                newest = max(ckpt.iterdir())
                sizes.append(sum(p.stat().st_size for p in newest.iterdir()))
        finally:
            await bus.close()
    finally:
        server.stop()
    off, on = statistics.median(plain), statistics.median(with_ckpt)
    return {
        "world_size": WORLD,
        "steps": STEPS,
        "checkpoint_every": EVERY,
        "checkpoints_per_run": STEPS // EVERY,
        "checkpoint_bytes": max(sizes),
        "step_ms_without": 1000 * off,
        "step_ms_with": 1000 * on,
        "step_ms_runs_without": [1000 * t for t in plain],
        "step_ms_runs_with": [1000 * t for t in with_ckpt],
        "step_time_ratio": on / off,
        "checkpoint_cost_ms": 1000 * statistics.median(costs),
        "step_time_ratio_within": 1 + statistics.median(costs) / (EVERY * on),
        "step_time_target": 1.02,
    }


def _launch(stack_dir: Path, work: Path, job_id: str, fault: bool) -> tuple[float, int, str]:
    """``torchrelay run`` of the test script on the stack; (wall s, exit code, output)."""
    env = dict(os.environ)
    env.update(
        TORCHRELAY_HOME=str(stack_dir),
        TR_STEPS=str(RESTART_STEPS),
        TR_WIDTH="1024",
        TR_DEPTH="3",
        TR_STEP_SLEEP_S="0",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    env.pop("NATS_URL", None)
    cmd = [sys.executable, "-m", "torchrelay.cli", "run", "--nproc", "3", "--spares", "0"]
    cmd += ["--job-id", job_id]
    if fault:
        env["TORCHRELAY_CHAOS_POINT"] = f"allreduce:{job_id}-w1:{RESTART_KILL_STEP}"
        cmd += ["--policy", "checkpoint_restart", "--checkpoint-dir", str(work / job_id)]
        cmd += ["--checkpoint-every", "10"]
    cmd.append(str(TRAIN_SCRIPT))
    started = time.monotonic()
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    return time.monotonic() - started, done.returncode, done.stdout + done.stderr


def _digests(stack_dir: Path, job_id: str) -> dict[int, str]:
    run_dir = stack_dir / "runs" / job_id
    return {
        int(json.loads(p.read_text())["rank"]): json.loads(p.read_text())["digest"]
        for p in run_dir.glob("*.digest.json")
    }


def _incident(stack_dir: Path, job_id: str) -> dict[str, Any]:
    """The job's incident once the restart's first step gave it a stall."""
    env = dict(os.environ, TORCHRELAY_HOME=str(stack_dir))
    env.pop("NATS_URL", None)
    deadline = time.monotonic() + 60
    while True:
        out = subprocess.run(
            [sys.executable, "-m", "torchrelay.cli", "incidents", "--job", job_id, "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        items = json.loads(out.stdout or "[]") if out.returncode == 0 else []
        items = items["items"] if isinstance(items, dict) else items
        found = [i for i in items if i.get("stall_ms") is not None]
        if found:
            return dict(found[0])
        if time.monotonic() > deadline:
            raise RuntimeError(f"no incident with a stall for {job_id}: {out.stdout[-500:]}")
        time.sleep(0.5)


def _restart(tmp: Path) -> dict[str, Any]:
    stack_dir = tmp / "stack"
    with RelayStack(stack_dir):
        clean_wall, code, out = _launch(stack_dir, tmp, "bench-restart-clean", False)
        if code != 0:
            raise RuntimeError(f"fault-free run exited {code}: {out[-2000:]}")
        fault_wall, code, out = _launch(stack_dir, tmp, "bench-restart-fault", True)
        if code != 0:
            raise RuntimeError(f"restart run exited {code}: {out[-2000:]}")
        incident = _incident(stack_dir, "bench-restart-fault")
        clean = _digests(stack_dir, "bench-restart-clean")
        fault = _digests(stack_dir, "bench-restart-fault")
    return {
        "restart_world_size": 3,
        "restart_kill_step": RESTART_KILL_STEP,
        "restart_resolution": incident["resolution"],
        "restart_lost_steps": incident["lost_steps"],
        "restart_fault_to_first_step_s": incident["stall_ms"] / 1000,
        "restart_wall_s": fault_wall,
        "restart_clean_wall_s": clean_wall,
        "restart_equal_final": bool(clean) and clean == fault,
    }


def run() -> dict[str, Any]:
    """Measure, print a small table, return the figures."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        figures = asyncio.run(_step_times(tmp))
        figures.update(_restart(tmp))
    print_figures("checkpoint benchmark (gloo, CPU, local disk)", figures)
    return figures


if __name__ == "__main__":
    run()
