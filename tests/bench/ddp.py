"""Benchmark: torchrelay's step against ``DistributedDataParallel`` on the same gloo ranks.

A decoder-only transformer of about 27M parameters (6 layers, width 512, vocabulary 8192,
sequences of 64, 4 per rank, AdamW), 2 ranks, one thread each. In each rank, blocks of DDP
steps (its own gloo group; ``gradient_as_bucket_view=True``, ``static_graph=True``, 25 MB
buckets: DDP at its documented best for a fixed graph) alternate with blocks of torchrelay
steps, so both see the same load; the figure is the ratio of the median step times. Run twice:
with torchrelay's overlap on (buckets all-reduced during backward, the default) and off (one
all-reduce after backward). Target: agent/DDP <= 1.03 with the overlap on.

No control plane: the test executor writes the generations.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from tests.bench import print_figures
from tests.helpers.relay import FakeExecutor, LaunchedJob
from torchrelay.bus import Bus
from torchrelay.runtime import free_port, nats_server

WORLD = 2
ENV = {"TR_BLOCKS": "6", "TR_BLOCK_STEPS": "6", "TORCHRELAY_VERIFY_EVERY": "0"}
SCRIPT = Path(__file__).with_name("_ddp_mixed.py")
TARGET = 1.03


async def compare(bus: Bus, url: str, tmp: Path, overlap: bool) -> dict[str, Any]:
    """Median DDP and torchrelay step times of one job (both kinds in the same ranks)."""
    job_id = f"bench-ddp-{'overlap' if overlap else 'flat'}"
    ex = await FakeExecutor(bus, job_id, WORLD).start()
    env = {**ENV, "TR_PLAIN_PORT": str(free_port()), "TORCHRELAY_OVERLAP": str(int(overlap))}
    job = LaunchedJob(job_id, url, tmp, nproc=WORLD, spares=0, env=env, script=SCRIPT)
    try:
        if await job.wait(1200) != 0:
            raise RuntimeError(f"{job_id} failed:\n{job.output()[-3000:]}")
    finally:
        job.close()
        await ex.stop()
    runs = [json.loads(p.read_text()) for p in sorted(job.run_dir.glob("*.ddp.json"))]
    ddp = statistics.median(statistics.median(r["ddp"]) for r in runs)
    agent = statistics.median(statistics.median(r["agent"]) for r in runs)
    return {"ddp_step_ms": 1000 * ddp, "agent_step_ms": 1000 * agent, "params": runs[0]["params"]}


async def _run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        server = nats_server(tmp / "nats")
        server.start()
        try:
            bus = await Bus.connect(server.url, "bench-ddp")
            await bus.provision_streams()
            try:
                on = await compare(bus, server.url, tmp, overlap=True)
                off = await compare(bus, server.url, tmp, overlap=False)
            finally:
                await bus.close()
        finally:
            server.stop()
    return {
        "world_size": WORLD,
        "parameters": on["params"],
        "ddp_settings": "gloo, gradient_as_bucket_view=True, static_graph=True, bucket_cap_mb=25",
        "overlap_ddp_step_ms": on["ddp_step_ms"],
        "overlap_agent_step_ms": on["agent_step_ms"],
        "overlap_ratio": on["agent_step_ms"] / on["ddp_step_ms"],
        "flat_ddp_step_ms": off["ddp_step_ms"],
        "flat_agent_step_ms": off["agent_step_ms"],
        "flat_ratio": off["agent_step_ms"] / off["ddp_step_ms"],
        "target_ratio": TARGET,
        "overlap_within_target": on["agent_step_ms"] / on["ddp_step_ms"] <= TARGET,
    }


def run() -> dict[str, Any]:
    """Measure, print a small table, return the figures."""
    figures = asyncio.run(_run())
    print_figures(f"torchrelay against DistributedDataParallel ({WORLD} ranks, gloo, CPU)", figures)
    return figures


if __name__ == "__main__":
    run()
