"""Control-plane benchmark: from a FaultDetected to the next generation, and to the ledger.

The scheduler, the migration executor and the spare pool run in-process against a real
``nats-server`` (JetStream, fsync always) and ``redis-server`` (AOF always); the job's agents
are simulated (JOINED / RESUMED reports), so this isolates what the control plane adds to a
migration's stall: ``fault_to_generation`` is the time from the detector's event to the new
generation being readable in the KV bucket the agents watch (every hop: scheduler consumer,
incident in Redis, MigrationRequested, executor consumer, saga persisted, spare-pool
reservation over RPC, KV compare-and-set). ``resumed_to_closed`` is the time from the last
RESUMED report to the IncidentClosed event (confirm, quarantine, fence, completion, close).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from services.migration_executor.service import ExecutorSettings
from services.migration_executor.service import setup as executor_setup
from services.scheduler.service import setup as scheduler_setup
from services.spare_pool.service import SparePoolSettings
from services.spare_pool.service import setup as spare_pool_setup
from tests.integration.migration_executor.harness import EventTap, SimJob
from torchrelay.bus import Bus
from torchrelay.contract import (
    FaultAction,
    FaultDetected,
    FaultKind,
    IncidentClosed,
    Severity,
    Subjects,
    make_event_id,
)
from torchrelay.runtime import nats_server, redis_server
from torchrelay.service import serve_service
from torchrelay.settings import ServiceSettings

MIGRATIONS = 30
WORLD = 4


def _pct(samples_ms: list[float]) -> dict[str, float]:
    ordered = sorted(samples_ms)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {
        "p50_ms": round(statistics.median(ordered), 2),
        "p95_ms": at(0.95),
        "max_ms": round(ordered[-1], 2),
        "mean_ms": round(statistics.fmean(ordered), 2),
    }


async def _measure(nats_url: str, redis_url: str) -> dict[str, Any]:
    common = {
        "nats_url": nats_url,
        "redis_url": redis_url,
        "environment": "test",
        "log_level": "ERROR",
        "connect_timeout_s": 10.0,
    }
    stop = asyncio.Event()
    ready: list[asyncio.Event] = []
    tasks = []
    for name, setup, settings in (
        ("spare_pool", spare_pool_setup, SparePoolSettings(**common)),
        ("scheduler", scheduler_setup, ServiceSettings(**common)),
        (
            "migration_executor",
            executor_setup,
            ExecutorSettings(**common, poll_s=0.05, retry_s=0.2),
        ),
    ):
        flag = asyncio.Event()
        ready.append(flag)
        tasks.append(
            asyncio.create_task(
                serve_service(name, setup, settings, stop=stop, on_ready=lambda _p, f=flag: f.set())
            )
        )
    bus = await Bus.connect(nats_url, "bench")
    tap = EventTap()
    try:
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in ready)), 60)
        await bus.provision_streams()
        await tap.start(bus)
        job = SimJob(bus, "bench-cp", world_size=WORLD, spares=MIGRATIONS)
        await job.start(timeout=60)
        to_gen: list[float] = []
        to_closed: list[float] = []
        gen = await job.generation(1)
        for i in range(MIGRATIONS):
            rank = i % WORLD
            holder = next(a for a in gen.ranks if a.rank == rank)
            fid = make_event_id("worker_lost", job.job_id, holder.member_id)
            fault = FaultDetected(
                event_id=make_event_id("fault", fid),
                source="bench",
                fault_id=fid,
                cluster="local",
                node=holder.node,
                gpu=holder.gpu,
                job_id=job.job_id,
                rank=rank,
                member_id=holder.member_id,
                kind=FaultKind.WORKER_LOST,
                severity=Severity.FATAL,
                action=FaultAction.MIGRATE_NOW,
            )
            started = time.perf_counter()
            await bus.publish(fault, Subjects.FAULT_DETECTED)
            while True:
                got = await bus.get_generation(job.job_id)
                if got is not None and got[0].generation > gen.generation:
                    break
                await asyncio.sleep(0.001)
            to_gen.append((time.perf_counter() - started) * 1000)
            gen = got[0]
            closed_before = len(tap.of(IncidentClosed))
            resumed_at = time.perf_counter()
            await job.resumed(gen)
            while len(tap.of(IncidentClosed)) <= closed_before:
                await asyncio.sleep(0.001)
            to_closed.append((time.perf_counter() - resumed_at) * 1000)
        return {
            "migrations": MIGRATIONS,
            "world_size": WORLD,
            "fault_to_generation": _pct(to_gen),
            "resumed_to_closed": _pct(to_closed),
        }
    finally:
        await tap.stop()
        await bus.close()
        stop.set()
        for task in tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 15)


def run() -> dict[str, Any]:
    """Measure, print a small table and return the figures."""
    with tempfile.TemporaryDirectory(prefix="tr-bench-cp-") as tmp:
        nats = nats_server(Path(tmp) / "nats")
        redis = redis_server(Path(tmp) / "redis")
        nats.start()
        redis.start()
        try:
            result = asyncio.run(_measure(nats.url, redis.url))
        finally:
            nats.stop()
            redis.stop()
    print(
        f"control plane, {result['migrations']} migrations of a {WORLD}-rank job "
        "(simulated agents, hot spares):"
    )
    print(f"  {'':24} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}")
    for key in ("fault_to_generation", "resumed_to_closed"):
        r = result[key]
        print(f"  {key:24} {r['p50_ms']:8.1f} {r['p95_ms']:8.1f} {r['max_ms']:8.1f}")
    return result


if __name__ == "__main__":
    run()
