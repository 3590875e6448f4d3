"""Benchmark of the in-job agent: its step-time overhead, and a SIGKILL handed to a hot spare.

For a 4-rank gloo job of an MLP with more than 2M parameters (AdamW, StepLR):
- median step time with the agent (``torchrelay run`` + the test executor) against a plain
  loop doing the same gloo all-reduce on a directly built process group (target ratio <= 1.03),
  measured in alternating blocks inside the same processes so both see the same load;
- for a SIGKILL of rank 1 with a hot spare: the survivors' stall (max RESUMED stall_ms) and
  recomputed steps (max lost_steps), against the target of 5 median step times plus the
  state's size over the measured loopback bandwidth.
No control plane: the test executor writes the generations.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.bench import print_figures
from tests.helpers.relay import FakeExecutor, LaunchedJob
from torchrelay.bus import Bus
from torchrelay.contract import ReportKind
from torchrelay.runtime import free_port, nats_server

WORLD = 4
STEPS = 60
SKIP = 8  # warm-up steps left out of the medians
# The guard is off as it is by default; run_overhead measures it on at every step apart.
ENV = {
    "TR_STEPS": str(STEPS),
    "TR_WIDTH": "1024",
    "TR_DEPTH": "3",
    "TR_STEP_SLEEP_S": "0",
    "TORCHRELAY_VERIFY_EVERY": "0",
}
MIXED = Path(__file__).with_name("_agent_mixed.py")


def params() -> int:
    w, d = int(ENV["TR_WIDTH"]), int(ENV["TR_DEPTH"])
    return 16 * w + w + (d - 1) * (w * w + w) + w + 1


def median_step(times_per_rank: list[list[float]]) -> float:
    """Median over ranks of the median gap between consecutive commits (after warm-up)."""
    meds = []
    for times in times_per_rank:
        gaps = [b - a for a, b in zip(times[SKIP:], times[SKIP + 1 :], strict=False)]
        meds.append(statistics.median(gaps))
    return statistics.median(meds)


def loopback_bandwidth(total: int = 256 << 20) -> float:
    """Bytes per second through a loopback TCP connection."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    chunk = b"\0" * (1 << 20)

    def sink() -> None:
        conn, _ = srv.accept()
        got = 0
        while got < total:
            data = conn.recv(1 << 20)
            if not data:
                break
            got += len(data)
        conn.close()

    t = threading.Thread(target=sink)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        started = time.perf_counter()
        for _ in range(total // len(chunk)):
            c.sendall(chunk)
    t.join()
    elapsed = time.perf_counter() - started
    srv.close()
    return total / elapsed


def commit_times(job: LaunchedJob) -> list[list[float]]:
    return [
        json.loads(p.read_text())["commit_times"] for p in sorted(job.run_dir.glob("*.digest.json"))
    ]


async def run_overhead(bus: Bus, url: str, tmp: Path, verify_every: int = 0) -> tuple[float, float]:
    """Median plain and agent step times, measured in alternating blocks in one job
    (``verify_every``: the divergence guard's period for the agent's steps, 0 off)."""
    job_id = f"bench-overhead-v{verify_every}"
    ex = await FakeExecutor(bus, job_id, WORLD).start()
    env = {
        **ENV,
        "TR_PLAIN_PORT": str(free_port()),
        "TR_BLOCKS": "6",
        "TR_BLOCK_STEPS": "10",
        "TORCHRELAY_VERIFY_EVERY": str(verify_every),
    }
    job = LaunchedJob(job_id, url, tmp, nproc=WORLD, spares=0, env=env, script=MIXED)
    try:
        if await job.wait(600) != 0:
            raise RuntimeError(f"agent run failed:\n{job.output()[-3000:]}")
    finally:
        job.close()
        await ex.stop()
    runs = [json.loads(p.read_text()) for p in sorted(job.run_dir.glob("*.mixed.json"))]
    plain = statistics.median(statistics.median(r["plain"]) for r in runs)
    agent = statistics.median(statistics.median(r["agent"]) for r in runs)
    return plain, agent


async def run_kill(bus: Bus, url: str, tmp: Path) -> dict[str, Any]:
    ex = await FakeExecutor(bus, "bench-kill", WORLD).start()
    job = LaunchedJob("bench-kill", url, tmp, nproc=WORLD, spares=1, env=ENV)
    try:
        victim = "bench-kill-w1"
        await ex.wait_for("step 20", lambda: ex.step_of(victim) >= 20, timeout=600)
        os.kill(job.pid_of(victim), signal.SIGKILL)
        if await job.wait(600) != 0:
            raise RuntimeError(f"kill run failed:\n{job.output()[-3000:]}")
        resumed = ex.of(ReportKind.RESUMED, generation=2)
    finally:
        job.close()
        await ex.stop()
    survivors = [r for r in resumed if r.member_id != "bench-kill-s0"]
    spare = [r for r in resumed if r.member_id == "bench-kill-s0"]
    return {
        "stall_ms": max(r.stall_ms or 0.0 for r in survivors),
        "lost_steps": max(r.lost_steps or 0 for r in resumed),
        "state_bytes": max((r.bytes_received or 0) for r in spare) if spare else 0,
        "ranks_resumed": len(resumed),
        "kill_step_time_s": median_step(commit_times(job)),
    }


async def _run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        server = nats_server(tmp / "nats")
        server.start()
        try:
            bus = await Bus.connect(server.url, "bench-agent")
            await bus.provision_streams()
            try:
                plain, agent = await run_overhead(bus, server.url, tmp)
                plain_v, agent_v = await run_overhead(bus, server.url, tmp, verify_every=1)
                kill = await run_kill(bus, server.url, tmp)
            finally:
                await bus.close()
        finally:
            server.stop()
    bandwidth = loopback_bandwidth()
    target_ms = 1000 * (5 * agent + kill["state_bytes"] / bandwidth)
    return {
        "world_size": WORLD,
        "parameters": params(),
        "steps": STEPS,
        "plain_step_ms": 1000 * plain,
        "agent_step_ms": 1000 * agent,
        "overhead_ratio": agent / plain,
        "overhead_target": 1.03,
        # The divergence guard at every step (sha256 of the whole tracked state, one
        # all-gather of 32 bytes), against plain steps measured in the same processes.
        "verify_every_1_plain_step_ms": 1000 * plain_v,
        "verify_every_1_agent_step_ms": 1000 * agent_v,
        "verify_every_1_overhead_ratio": agent_v / plain_v,
        "kill_stall_ms": kill["stall_ms"],
        "kill_lost_steps": kill["lost_steps"],
        "state_bytes": kill["state_bytes"],
        "loopback_MBps": bandwidth / 1e6,
        "stall_target_ms": target_ms,
        "stall_within_target": kill["stall_ms"] <= target_ms,
    }


def run() -> dict[str, Any]:
    """Measure, print a small table, return the figures."""
    figures = asyncio.run(_run())
    print_figures("agent benchmark (4 ranks, gloo, CPU)", figures)
    return figures


if __name__ == "__main__":
    run()
