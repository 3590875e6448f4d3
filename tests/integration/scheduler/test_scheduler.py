"""The scheduler alone against real NATS and Redis: registry, incidents, queries, drains.

The executor is not running here; the test plays it where needed (generations KV,
GenerationChanged, MigrationCompleted/Failed).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import redis.asyncio as aioredis

from tests.integration.migration_executor.harness import (
    EventTap,
    SimJob,
    control_plane,
    scheduler_rpc,
    wait_until,
)
from torchrelay.bus import Bus, RpcFailed
from torchrelay.contract import (
    DrainRequested,
    FaultAction,
    FaultKind,
    Generation,
    GenerationChanged,
    Heartbeat,
    IncidentClosed,
    IncidentOpened,
    JobFinished,
    MigrationCompleted,
    MigrationFailed,
    MigrationMode,
    MigrationRequested,
    RankAssignment,
    Resolution,
    Severity,
    Subjects,
    make_event_id,
)

pytestmark = pytest.mark.slow


async def formed(bus: Bus, job: SimJob) -> Generation:
    """Play the executor's formation: generation 1 and its GenerationChanged."""
    await job.register()
    gen = Generation(
        job_id=job.job_id,
        generation=1,
        world_size=job.world_size,
        ranks=[
            RankAssignment(
                rank=i,
                member_id=job.worker(i).member_id,
                node=job.worker(i).node,
                gpu=job.worker(i).gpu,
            )
            for i in range(job.world_size)
        ],
        store_member=job.worker(0).member_id,
        store_addr="127.0.0.1:1",
    )
    await bus.put_generation(gen, None)
    await bus.publish(
        GenerationChanged(
            event_id=make_event_id("generation", job.job_id, 1),
            source="test",
            job_id=job.job_id,
            generation=1,
            previous=0,
            ranks=gen.ranks,
            reason="formed",
        ),
        Subjects.GENERATION_CHANGED,
    )

    async def running() -> bool:
        view = await scheduler_rpc(bus, "job_get", {"job_id": job.job_id})
        return view["generation"] == 1

    await wait_until(running, what="the job running in generation 1")
    return gen


async def test_job_registry_answers_queries_with_placements_and_committed_step(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
) -> None:
    job = SimJob(bus, "q1", tenant="acme")
    other = SimJob(bus, "q2", tenant="globex", world_size=2)
    async with control_plane(nats_url, redis_url, executor=False):
        await formed(bus, job)
        await other.register()
        for step in (3, 9, 7):  # out of order across ranks: the highest wins
            await bus.publish_core(
                Subjects.heartbeat("q1"),
                Heartbeat(
                    event_id=f"hb{step}",
                    source="agent",
                    job_id="q1",
                    member_id="q1-w0",
                    rank=0,
                    generation=1,
                    step=step,
                    node="local-0",
                    gpu=0,
                    pid=1000,
                ),
            )

        async def stepped() -> bool:
            view = await scheduler_rpc(bus, "job_get", {"job_id": "q1"})
            return view["committed_step"] == 9

        await wait_until(stepped, what="committed_step 9")
        view = await scheduler_rpc(bus, "job_get", {"job_id": "q1"})
        assert view["state"] == "running"
        assert view["world_size"] == 4
        assert view["ranks"][0] == {
            "rank": 0,
            "node": "local-0",
            "gpu": 0,
            "pid": 1000,
            "member_id": "q1-w0",
        }
        assert [r["node"] for r in view["ranks"]] == ["local-0", "local-1", "local-0", "local-1"]

        page = await scheduler_rpc(bus, "job_list", {"tenant": "acme"})
        assert [j["job_id"] for j in page["items"]] == ["q1"]  # type: ignore[index]
        first = await scheduler_rpc(bus, "job_list", {"limit": 1})
        assert len(first["items"]) == 1  # type: ignore[arg-type]
        assert first["next_cursor"] == "1"
        rest = await scheduler_rpc(bus, "job_list", {"limit": 1, "cursor": "1"})
        assert rest["next_cursor"] is None

        with pytest.raises(RpcFailed) as missing:
            await scheduler_rpc(bus, "job_get", {"job_id": "nope"})
        assert missing.value.error.code == "not_found"
        with pytest.raises(RpcFailed) as bad:
            await scheduler_rpc(bus, "job_list", {"limit": 0})
        assert bad.value.error.field == "limit"

        await bus.publish(
            JobFinished(
                event_id="fin-q1",
                source="launcher",
                job_id="q1",
                tenant="acme",
                outcome="succeeded",
                committed_step=20,
            ),
            Subjects.JOB_FINISHED,
        )

        async def finished() -> bool:
            view = await scheduler_rpc(bus, "job_get", {"job_id": "q1"})
            return view["state"] == "succeeded" and view["committed_step"] == 20

        await wait_until(finished, what="the job finished")


async def test_one_incident_per_fault_folds_duplicates_and_closes_on_completion(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
) -> None:
    job = SimJob(bus, "f1")
    async with control_plane(nats_url, redis_url, executor=False):
        await formed(bus, job)
        lost = job.fault(rank=2)
        await bus.publish(lost, Subjects.FAULT_DETECTED)
        request = await tap.wait(MigrationRequested, job_id="f1")
        assert request.mode == MigrationMode.IMMEDIATE
        assert (request.rank, request.member_id, request.node, request.gpu) == (
            2,
            "f1-w2",
            "local-0",
            1,
        )
        assert request.migration_id == make_event_id("migration", request.incident_id)
        # The same fault again (new message id), and the GPU dying under the same rank:
        # both fold into the open incident; nothing new is requested.
        await bus.publish(lost.model_copy(update={"event_id": "again"}), Subjects.FAULT_DETECTED)
        gpu = job.fault(FaultKind.GPU_LOST, node="local-0", gpu=1)
        await bus.publish(gpu, Subjects.FAULT_DETECTED)

        async def folded() -> list[object]:
            got = await scheduler_rpc(bus, "incident_get", {"incident_id": request.incident_id})
            return got["folded_faults"]  # type: ignore[return-value]

        assert await wait_until(folded, what="the GPU fault folded") == [
            {"fault_id": gpu.fault_id, "kind": "gpu_lost"}
        ]
        await tap.wait(IncidentOpened)
        assert len(tap.of(MigrationRequested)) == 1
        assert len(tap.of(IncidentOpened)) == 1

        # The executor reports success: the incident closes once, with the figures.
        done = MigrationCompleted(
            event_id="done-1",
            source="migration_executor",
            migration_id=request.migration_id,
            incident_id=request.incident_id,
            job_id="f1",
            rank=2,
            mode=MigrationMode.IMMEDIATE,
            to_node="local-2",
            to_gpu=0,
            generation_before=1,
            generation_after=2,
            stall_ms=61.5,
            lost_steps=1,
            bytes_moved=999,
        )
        await bus.publish(done, Subjects.MIGRATION_COMPLETED)
        await bus.publish(
            done.model_copy(update={"event_id": "done-2"}), Subjects.MIGRATION_COMPLETED
        )
        closed = await tap.wait(IncidentClosed)
        inc = closed.incident
        assert inc.resolution == Resolution.MIGRATED_LIVE
        assert (inc.stall_ms, inc.lost_steps, inc.bytes_moved) == (61.5, 1, 999)
        assert (inc.generation_before, inc.generation_after) == (1, 2)
        got = await scheduler_rpc(bus, "incident_get", {"incident_id": inc.incident_id})
        assert got["resolution"] == "migrated_live"
        assert got["stall_ms"] == 61.5

        # The consumer handles events in order: once a later event shows, the duplicate
        # completion was handled too.
        await bus.publish(
            JobFinished(
                event_id="fin-f1",
                source="launcher",
                job_id="f1",
                tenant="acme",
                outcome="succeeded",
            ),
            Subjects.JOB_FINISHED,
        )

        async def quiet() -> bool:
            view = await scheduler_rpc(bus, "job_get", {"job_id": "f1"})
            return view["state"] == "succeeded"

        await wait_until(quiet, what="the events after the duplicate handled")
        assert len(tap.of(IncidentClosed)) == 1

        timeline = await scheduler_rpc(bus, "job_timeline", {"job_id": "f1"})
        kinds = [e["type"] for e in timeline["events"]]  # type: ignore[union-attr, index]
        assert kinds[:5] == [
            "job_registered",
            "generation",
            "incident_opened",
            "migration_requested",
            "migration_completed",
        ]
        assert "incident_closed" in kinds
        assert [g["generation"] for g in timeline["generations"]] == [1]  # type: ignore[union-attr, index]
        assert len(timeline["incidents"]) == 1  # type: ignore[arg-type]


async def test_failed_migration_closes_with_the_fallback(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
) -> None:
    job = SimJob(bus, "f2")
    async with control_plane(nats_url, redis_url, executor=False):
        await formed(bus, job)
        await bus.publish(job.fault(rank=0), Subjects.FAULT_DETECTED)
        request = await tap.wait(MigrationRequested, job_id="f2")
        await bus.publish(
            MigrationFailed(
                event_id="failed",
                source="migration_executor",
                migration_id=request.migration_id,
                incident_id=request.incident_id,
                job_id="f2",
                reason="no spare",
                fallback=Resolution.CHECKPOINT_RESTART,
            ),
            Subjects.MIGRATION_FAILED,
        )
        closed = await tap.wait(IncidentClosed)
        assert closed.incident.resolution == Resolution.CHECKPOINT_RESTART
        listed = await scheduler_rpc(bus, "incident_list", {"resolution": "checkpoint_restart"})
        assert [i["incident_id"] for i in listed["items"]] == [  # type: ignore[union-attr]
            request.incident_id
        ]
        assert (await scheduler_rpc(bus, "incident_list", {"resolution": "migrated_live"}))[
            "items"
        ] == []


async def test_node_fault_opens_one_incident_per_hurt_rank_and_info_is_recorded(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
) -> None:
    job = SimJob(bus, "f3")
    async with control_plane(nats_url, redis_url, executor=False):
        await formed(bus, job)
        # A warning on the whole node local-1 (ranks 1 and 3): two boundary migrations.
        warn = job.fault(
            FaultKind.THERMAL_SLOWDOWN,
            node="local-1",
            severity=Severity.WARNING,
            action=FaultAction.MIGRATE_AT_BOUNDARY,
        )
        await bus.publish(warn, Subjects.FAULT_DETECTED)

        async def two() -> list[MigrationRequested]:
            found = tap.of(MigrationRequested, job_id="f3")
            return found if len(found) == 2 else []

        requests = await wait_until(two, what="two migration requests")
        assert sorted(r.rank for r in requests) == [1, 3]
        assert {r.mode for r in requests} == {MigrationMode.BOUNDARY}
        # An informational fault on a rank is only recorded.
        info = job.fault(
            FaultKind.STRAGGLER, rank=0, severity=Severity.INFO, action=FaultAction.RECORD
        )
        await bus.publish(info, Subjects.FAULT_DETECTED)
        closed = await tap.wait(IncidentClosed)
        assert closed.incident.resolution == Resolution.EXCLUDED
        assert closed.incident.rank == 0
        # Filters: by job, by tenant, by detection time.
        assert len((await scheduler_rpc(bus, "incident_list", {"job_id": "f3"}))["items"]) == 3  # type: ignore[arg-type]
        assert (await scheduler_rpc(bus, "incident_list", {"tenant": "other"}))["items"] == []
        future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        assert (await scheduler_rpc(bus, "incident_list", {"from": future}))["items"] == []
        page = await scheduler_rpc(bus, "incident_list", {"job_id": "f3", "limit": 2})
        assert len(page["items"]) == 2  # type: ignore[arg-type]
        assert page["next_cursor"] == "2"
        with pytest.raises(RpcFailed) as bad:
            await scheduler_rpc(bus, "incident_list", {"resolution": "fixed"})
        assert bad.value.error.field == "resolution"


async def test_fault_of_a_replaced_member_opens_nothing(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
) -> None:
    job = SimJob(bus, "f4")
    async with control_plane(nats_url, redis_url, executor=False):
        gen1 = await formed(bus, job)
        ranks = [
            a if a.rank != 1 else RankAssignment(rank=1, member_id="f4-s0", node="local-2", gpu=0)
            for a in gen1.ranks
        ]
        await bus.publish(
            GenerationChanged(
                event_id=make_event_id("generation", "f4", 2),
                source="test",
                job_id="f4",
                generation=2,
                previous=1,
                ranks=ranks,
                reason="worker_lost",
            ),
            Subjects.GENERATION_CHANGED,
        )

        async def moved() -> bool:
            view = await scheduler_rpc(bus, "job_get", {"job_id": "f4"})
            return view["generation"] == 2

        await wait_until(moved, what="generation 2 applied")
        # The fenced old process dies (exit by SIGKILL): that is not a new failure.
        await bus.publish(job.fault(rank=1, fault_id="late-exit"), Subjects.FAULT_DETECTED)
        # A fault that does hurt someone, as a marker that the first one was handled.
        await bus.publish(job.fault(rank=3), Subjects.FAULT_DETECTED)
        marker = await tap.wait(MigrationRequested, job_id="f4")
        assert marker.rank == 3
        opened = await tap.wait(IncidentOpened)  # published right after the request
        assert opened.incident.rank == 3
        assert len(tap.of(IncidentOpened)) == 1


async def test_drain_event_and_rpc_move_every_rank_on_the_node_at_boundaries(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
) -> None:
    job = SimJob(bus, "d1")
    async with control_plane(nats_url, redis_url, executor=False):
        await formed(bus, job)
        await bus.publish(
            DrainRequested(event_id="drain-1", source="api", cluster="local", node="local-0"),
            Subjects.DRAIN_REQUESTED,
        )

        async def two() -> list[MigrationRequested]:
            found = tap.of(MigrationRequested, job_id="d1")
            return found if len(found) == 2 else []

        requests = await wait_until(two, what="a migration per rank on local-0")
        assert sorted(r.rank for r in requests) == [0, 2]
        assert {r.fault_kind for r in requests} == {FaultKind.PLANNED_DRAIN}
        assert {r.mode for r in requests} == {MigrationMode.BOUNDARY}

        reply = await scheduler_rpc(bus, "drain", {"node": "local-1"})
        assert reply["cluster"] == "local"
        assert sorted(r["rank"] for r in reply["ranks"]) == [1, 3]  # type: ignore[union-attr, index]

        async def four() -> bool:
            return len(tap.of(MigrationRequested, job_id="d1")) == 4

        await wait_until(four, what="a migration per rank on local-1")
        with pytest.raises(RpcFailed) as bad:
            await scheduler_rpc(bus, "drain", {"node": "bad node!"})
        assert bad.value.error.field == "node"


async def test_a_crash_after_the_incident_was_stored_is_driven_again_on_redelivery(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
) -> None:
    """The scheduler stores the incident before it publishes; if it dies in between, the
    redelivered fault finds the incident and publishes what is missing, once."""
    import logging

    from services.scheduler import rules
    from services.scheduler.service import Scheduler
    from torchrelay.observability import ServiceMetrics
    from torchrelay.service import ServiceContext
    from torchrelay.settings import ServiceSettings

    job = SimJob(bus, "c1")
    async with control_plane(nats_url, redis_url, executor=False):
        await formed(bus, job)
    # The scheduler "died" right after storing the incident: replay that state by hand.
    ctx = ServiceContext(
        "scheduler",
        ServiceSettings(nats_url=nats_url, redis_url=redis_url),
        bus,
        redis,
        ServiceMetrics("scheduler"),
        logging.getLogger("t"),
    )
    scheduler = Scheduler(ctx)
    fault = job.fault(rank=1)
    placement = next(p for p in await scheduler.jobs.active_placements() if p.rank == 1)
    incident = rules.open_incident(fault, placement)
    assert (await scheduler.incidents.open(incident, "c1-w1", {"decision": "migrate_now"}))[
        0
    ] == "opened"
    assert tap.of(MigrationRequested) == []
    # The redelivery: the incident exists, so it is driven, not opened again.
    await scheduler.on_fault(fault)
    await scheduler.on_fault(fault)
    request = await tap.wait(MigrationRequested, job_id="c1")
    assert request.incident_id == incident.incident_id
    await tap.wait(IncidentOpened)
    assert len(tap.of(MigrationRequested)) == 1  # JetStream dedupes the second publish
    assert len(tap.of(IncidentOpened)) == 1
