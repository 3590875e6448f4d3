"""kill -9 of the executor mid-saga: the restarted process finishes it, exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess

import pytest
import redis.asyncio as aioredis

from torchrelay.bus import Bus
from torchrelay.contract import (
    IncidentClosed,
    MigrationCompleted,
    Resolution,
    Subjects,
)

from .harness import (
    EventTap,
    SimJob,
    SparePoolView,
    control_plane,
    executor_process,
    incident_closed,
    wait_until,
)

pytestmark = pytest.mark.slow

CRASH_EXIT = 86


@pytest.fixture
def pool(bus: Bus, tap: EventTap) -> SparePoolView:
    return SparePoolView(bus, tap)


async def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 15)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait, 5)


@pytest.mark.parametrize("crash_at", ["after_reserve", "after_publish"])
async def test_killed_executor_resumes_the_saga_without_leaking_or_repeating(
    crash_at: str,
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, f"crash-{crash_at.replace('_', '-')}")
    first = executor_process(nats_url, redis_url, TORCHRELAY_TEST_CRASH_AT=crash_at)
    second: subprocess.Popen[bytes] | None = None
    try:
        async with control_plane(nats_url, redis_url, executor=False):
            await job.start(timeout=90)
            await bus.publish(job.fault(rank=1), Subjects.FAULT_DETECTED)
            # The executor dies like kill -9 right after the named step.
            code = await asyncio.to_thread(first.wait, 60)
            assert code == CRASH_EXIT, (first.stderr.read() if first.stderr else b"")[-2000:]
            assert await pool.in_state("reserved") == ["local:local-2:0"]  # not confirmed
            current = await bus.get_generation(job.job_id)
            assert current is not None
            assert current[0].generation == (1 if crash_at == "after_reserve" else 2)

            # Restarted as a supervisor would: same environment, crash hook included. The
            # hook fires once per saga, so this one finishes the saga.
            second = executor_process(nats_url, redis_url, TORCHRELAY_TEST_CRASH_AT=crash_at)
            gen2 = await job.generation(2, timeout=90)
            assert gen2.ranks[1].member_id == f"{job.job_id}-s0"
            await job.resumed(gen2, {f"{job.job_id}-w0": {"stall_ms": 80.0}})
            inc = (await incident_closed(tap, job.job_id, timeout=60)).incident
            assert inc.resolution == Resolution.MIGRATED_LIVE
            assert inc.stall_ms == 80.0

            async def settled() -> bool:
                return (await pool.slot("local:local-2:0"))["state"] == "in_use"

            await wait_until(settled, what="the lease confirmed")
            # One reservation, confirmed: nothing leaked, nothing reserved twice.
            assert len(pool.reservations()) == 1
            assert await pool.in_state("reserved") == []
            assert len(tap.of(MigrationCompleted, job_id=job.job_id)) == 1
            assert len([e for e in tap.of(IncidentClosed) if e.incident.job_id == job.job_id]) == 1
            assert (await bus.get_generation(job.job_id))[0].generation == 2  # type: ignore[index]
    finally:
        with contextlib.suppress(Exception):
            await _stop(first)
        if second is not None:
            await _stop(second)
