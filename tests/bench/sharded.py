"""Sharded bench: what pure FSDP's buddy copies cost, and a SIGKILL's stall for FSDP2,
HSDP and replicated data parallelism side by side (docs/design.md §12).

The job: ``tests/helpers/train_fsdp.py`` on 4 gloo ranks, an MLP of ``WIDTH``-wide layers
(``HIDDEN`` of them: about 50M parameters), AdamW, the global gradient clipped; the test
executor writes the generations (no control plane).

1. Buddy copies: FSDP2 with them (the default) against ``TORCHRELAY_BUDDY_COPIES=0``, in
   alternating runs (``RUNS`` of each): the median step time after warm-up (target: with /
   without <= 1.05) and each rank's peak resident memory, its excess over the run without
   copies given in shards (one rank's share of the parameters and AdamW's two moments;
   target: one shard).
2. Stall: rank 1 SIGKILLed in the backward of step ``KILL_STEP`` with one hot spare, for
   FSDP2 (restored from its buddy's copy), HSDP 2x2 (from its replica) and replicated data
   parallelism (from any survivor): the survivors' stall from their RESUMED reports, and
   the bytes the spare received.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import statistics
import tempfile
from pathlib import Path
from typing import Any

from tests.bench import print_figures
from tests.helpers.relay import FakeExecutor, LaunchedJob
from torchrelay.bus import Bus
from torchrelay.contract import ReportKind
from torchrelay.runtime import nats_server

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "train_fsdp.py"
WORLD = 4
WIDTH = 2048
HIDDEN = 12
STEPS = 14
SKIP = 4
RUNS = 2
KILL_STEP = 8
ENV = {
    "TR_WIDTH": str(WIDTH),
    "TR_HIDDEN": str(HIDDEN),
    "TR_STEPS": str(STEPS),
    "TORCHRELAY_VERIFY_EVERY": "0",
    "TORCHRELAY_COLLECTIVE_TIMEOUT_S": "300",
}


def params() -> int:
    return 16 * WIDTH + WIDTH + HIDDEN * (WIDTH * WIDTH + WIDTH) + WIDTH + 1


def _records(job: LaunchedJob) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(job.run_dir.glob("*.digest.json"))]


def median_step(records: list[dict[str, Any]]) -> float:
    """Median over ranks of the median gap between consecutive steps after warm-up."""
    meds = []
    for rec in records:
        times = rec["step_times"][SKIP:]
        meds.append(statistics.median(b - a for a, b in itertools.pairwise(times)))
    return statistics.median(meds)


async def _run(
    bus: Bus, url: str, tmp: Path, job_id: str, env: dict[str, str], kill: bool = False
) -> tuple[list[dict[str, Any]], list[Any]]:
    ex = await FakeExecutor(bus, job_id, WORLD).start()
    job = LaunchedJob(
        job_id, url, tmp, nproc=WORLD, spares=1 if kill else 0, env={**ENV, **env}, script=SCRIPT
    )
    try:
        if kill:
            victim = f"{job_id}-w1"
            await ex.wait_for("the kill step", lambda: ex.step_of(victim) >= KILL_STEP - 1, 900)
            os.kill(job.pid_of(victim), signal.SIGKILL)
        if await job.wait(1200) != 0:
            raise RuntimeError(f"{job_id} failed:\n{job.output()[-3000:]}")
        resumed = ex.of(ReportKind.RESUMED, generation=2)
    finally:
        job.close()
        await ex.stop()
    return _records(job), resumed


async def _bench(tmp: Path) -> dict[str, Any]:
    server = nats_server(tmp / "nats")
    server.start()
    out: dict[str, Any] = {"world_size": WORLD, "parameters": params(), "steps": STEPS}
    try:
        bus = await Bus.connect(server.url, "bench-sharded")
        await bus.provision_streams()
        try:
            with_copies, without = [], []
            rss_with, rss_without = [], []
            for i in range(RUNS):
                on, _ = await _run(bus, server.url, tmp, f"fsdp-on-{i}", {"TR_MESH": "fsdp"})
                off, _ = await _run(
                    bus,
                    server.url,
                    tmp,
                    f"fsdp-off-{i}",
                    {"TR_MESH": "fsdp", "TORCHRELAY_BUDDY_COPIES": "0"},
                )
                with_copies.append(median_step(on))
                without.append(median_step(off))
                rss_with.append(statistics.median(r["max_rss_bytes"] for r in on))
                rss_without.append(statistics.median(r["max_rss_bytes"] for r in off))
            # One rank's shard: its parameters and AdamW's two moments, in float32.
            shard = 3 * 4 * params() / WORLD
            extra = statistics.median(rss_with) - statistics.median(rss_without)
            out.update(
                step_ms_with_copies=1000 * statistics.median(with_copies),
                step_ms_without_copies=1000 * statistics.median(without),
                step_ms_runs_with=[1000 * t for t in with_copies],
                step_ms_runs_without=[1000 * t for t in without],
                step_time_ratio=statistics.median(with_copies) / statistics.median(without),
                step_time_target=1.05,
                shard_bytes=shard,
                peak_rss_with_bytes=statistics.median(rss_with),
                peak_rss_without_bytes=statistics.median(rss_without),
                extra_memory_shards=extra / shard,
                extra_memory_target_shards=1.0,
            )
            for mesh in ("fsdp", "hsdp", "replicated"):
                _, resumed = await _run(
                    bus, server.url, tmp, f"{mesh}-kill", {"TR_MESH": mesh}, kill=True
                )
                survivors = [r for r in resumed if not r.member_id.endswith("-s0")]
                spare = [r for r in resumed if r.member_id.endswith("-s0")]
                out[f"{mesh}_kill_stall_ms"] = max((r.stall_ms or 0.0) for r in survivors)
                out[f"{mesh}_kill_bytes_received"] = max((r.bytes_received or 0) for r in spare)
        finally:
            await bus.close()
    finally:
        server.stop()
    return out


def run() -> dict[str, Any]:
    """Measure, print a small table, return the figures."""
    with tempfile.TemporaryDirectory() as d:
        figures = asyncio.run(_bench(Path(d)))
    print_figures(
        f"sharded benchmark ({WORLD} gloo ranks, {params() / 1e6:.1f}M parameters, CPU)", figures
    )
    return figures


if __name__ == "__main__":
    run()
