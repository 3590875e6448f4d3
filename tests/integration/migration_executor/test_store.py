"""The executor's store on a real Redis: what a saga's creation and saves tell the runner.

Creation and every save read the saga's step flags in the same round trip (the runner's next
step needs them); creation also takes the job's lock when no other migration holds it. A
RESUMED report's write tells the service, in the same round trip, whether it is the last one
a saga waits for.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import redis.asyncio as aioredis

from services.migration_executor import saga
from services.migration_executor.saga import JobTerms
from services.migration_executor.store import ExecutorStore, Flags, ResumedSoFar
from torchrelay.contract import (
    AgentReport,
    FaultKind,
    MigrationMode,
    MigrationRequested,
    ReportKind,
    Role,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _request(migration_id: str, job_id: str) -> MigrationRequested:
    return MigrationRequested(
        event_id=f"r-{migration_id}",
        source="scheduler",
        migration_id=migration_id,
        incident_id=f"i-{migration_id}",
        job_id=job_id,
        tenant="acme",
        rank=1,
        member_id=f"{job_id}-w1",
        node="local-1",
        gpu=0,
        mode=MigrationMode.IMMEDIATE,
        fault_kind=FaultKind.WORKER_LOST,
        generation_before=1,
    )


async def test_creation_takes_a_free_lock_and_reads_the_flags(
    redis: aioredis.Redis,
) -> None:
    store = ExecutorStore(redis, f"test:{uuid.uuid4().hex[:8]}")
    job = "j1"
    first = _request("m1", job)
    state = saga.start(first, JobTerms(world_size=4), T0)
    made = await store.create(state, first)
    assert made.created is True
    assert made.flags == Flags(escalation=False, job_finished=False)
    assert await store.job_lock_holder(job) == "m1"

    # A second migration of the same job while the first holds the lock: stored, the lock
    # left with the first.
    await store.mark_finished(job, "succeeded")
    second = _request("m2", job)
    made = await store.create(saga.start(second, JobTerms(world_size=4), T0), second)
    assert made.created is True
    assert made.flags == Flags(escalation=False, job_finished=True)
    assert await store.job_lock_holder(job) == "m1"

    # A redelivered request: nothing new.
    again = await store.create(state, first)
    assert again.created is False


async def test_a_save_returns_the_flags_as_they_are_after_it(redis: aioredis.Redis) -> None:
    store = ExecutorStore(redis, f"test:{uuid.uuid4().hex[:8]}")
    request = _request("m1", "j1")
    state = saga.start(request, JobTerms(world_size=4), T0)
    await store.create(state, request)
    assert await store.save(state) == Flags(escalation=False, job_finished=False)
    await store.request_escalation("m1")
    moved = state.model_copy(update={"updated_at": datetime(2026, 1, 2, tzinfo=UTC)})
    assert await store.save(moved) == Flags(escalation=True, job_finished=False)
    loaded = await store.load("m1")
    assert loaded is not None
    assert loaded.updated_at == moved.updated_at
    assert await store.step_flags("m1", "j1") == Flags(escalation=True, job_finished=False)


def _resumed(job_id: str, member_id: str, generation: int) -> AgentReport:
    return AgentReport(
        event_id=f"resumed-{member_id}-{generation}",
        source=f"agent:{member_id}",
        job_id=job_id,
        member_id=member_id,
        kind=ReportKind.RESUMED,
        role=Role.WORKER,
        node="local-0",
        gpu=0,
        pid=1,
        cluster="local",
        generation=generation,
        rank=0,
        step=50,
        stall_ms=120.0,
        lost_steps=0,
        bytes_received=28_545_133,
    )


async def test_a_resumed_report_says_whether_it_completes_what_a_saga_awaits(
    redis: aioredis.Redis,
) -> None:
    prefix = f"test:{uuid.uuid4().hex[:8]}"
    store = ExecutorStore(redis, prefix)
    job = "j1"
    # No saga has named generation 1: nothing is known to be awaited.
    first = await store.add_resumed(_resumed(job, "w0", 1))
    assert first == ResumedSoFar(reported=1, awaited=None, job_finished=False)

    request = _request("m1", job)
    state = saga.start(request, JobTerms(world_size=3), T0)
    await store.create(state, request)
    named = state.model_copy(update={"generation_after": 2, "members_after": ["w0", "w1", "s0"]})
    await store.save(named)
    first_of_two = await store.add_resumed(_resumed(job, "w0", 2))
    assert first_of_two == ResumedSoFar(reported=1, awaited=3, job_finished=False)
    assert (await store.add_resumed(_resumed(job, "s0", 2))).reported == 2
    # A redelivered report counts once.
    assert (await store.add_resumed(_resumed(job, "s0", 2))).reported == 2
    # A saga polled before its deadline asks for all three: two are not read at all.
    assert await store.resumed(job, 2, at_least=3) is None
    partial = await store.resumed(job, 2)
    assert partial is not None
    assert set(partial) == {"w0", "s0"}
    last = await store.add_resumed(_resumed(job, "w1", 2))
    assert last == ResumedSoFar(reported=3, awaited=3, job_finished=False)
    complete = await store.resumed(job, 2, at_least=3)
    assert complete is not None
    assert set(complete) == {"w0", "w1", "s0"}
    assert complete["w1"] == {
        "rank": 0,
        "step": 50,
        "stall_ms": 120.0,
        "lost_steps": 0,
        "bytes_received": 28_545_133,
    }

    await store.mark_finished(job, "succeeded")
    assert (await store.add_resumed(_resumed(job, "w1", 2))).job_finished is True
    # A finished job's reports, and what its sagas awaited, expire.
    await store.forget_reports(job, after_s=60)
    for key in (f"{prefix}:resumed:{job}:2", f"{prefix}:awaited:{job}:2"):
        assert 0 < await redis.ttl(key) <= 60
