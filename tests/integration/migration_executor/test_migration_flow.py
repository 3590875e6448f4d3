"""A fault becomes an incident, a migration, a new generation and a closed incident.

Real NATS and Redis; scheduler and executor in-process; agents, launcher and spare pool
simulated by the test (see harness.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from services.migration_executor.runner import REPORTS_DURABLE
from torchrelay.bus import Bus
from torchrelay.contract import (
    EVENTS_STREAM,
    FaultAction,
    FaultDetected,
    FaultKind,
    GenerationChanged,
    IncidentClosed,
    IncidentOpened,
    JobPolicy,
    Member,
    MigrationCompleted,
    MigrationFailed,
    MigrationMode,
    MigrationRequested,
    Resolution,
    Role,
    Severity,
    SpareSlot,
    Subjects,
    make_event_id,
)

from .harness import EventTap, SimJob, SparePoolView, control_plane, incident_closed, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def pool(bus: Bus, tap: EventTap) -> SparePoolView:
    return SparePoolView(bus, tap)


SURVIVOR_FIGURES = {
    "j1-w0": {"stall_ms": 41.0, "lost_steps": 1},
    "j1-w2": {"stall_ms": 57.0, "lost_steps": 1},
    "j1-w3": {"stall_ms": 38.0, "lost_steps": 0},
    "j1-s0": {"stall_ms": 5000.0, "lost_steps": 0, "bytes_received": 4096},
}


async def test_worker_lost_migrates_live_to_the_hot_spare(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j1")
    async with control_plane(nats_url, redis_url):
        gen1 = await job.start()
        assert [a.member_id for a in gen1.ranks] == ["j1-w0", "j1-w1", "j1-w2", "j1-w3"]
        assert gen1.store_member == "j1-w0"

        await bus.publish(job.fault(rank=1), Subjects.FAULT_DETECTED)
        gen2 = await job.generation(2)
        assert gen2.ranks[1].member_id == "j1-s0"
        assert (gen2.ranks[1].node, gen2.ranks[1].gpu) == ("local-2", 0)
        assert gen2.departing == ["j1-w1"]
        assert gen2.mode == MigrationMode.IMMEDIATE
        assert gen2.store_member == "j1-w0"
        await job.resumed(gen2, SURVIVOR_FIGURES)

        closed = await incident_closed(tap, "j1")
        inc = closed.incident
        assert inc.resolution == Resolution.MIGRATED_LIVE
        assert inc.stall_ms == 57.0  # the survivors' longest stall, not the spare's start-up
        assert inc.lost_steps == 1
        assert inc.bytes_moved == 4096
        assert (inc.generation_before, inc.generation_after) == (1, 2)
        assert (inc.rank, inc.node, inc.gpu) == (1, "local-1", 0)

        done = tap.of(MigrationCompleted)
        assert len(done) == 1
        assert (done[0].to_node, done[0].to_gpu) == ("local-2", 0)
        assert [f.member_id for f in job.fences] == ["j1-w1"]
        spare = await pool.slot("local:local-2:0")
        assert (spare["state"], spare["job_id"]) == ("in_use", "j1")  # confirmed
        assert await pool.in_state("reserved") == []  # no lease left dangling
        # A killed process says nothing about its GPU: the slot stays in service.
        await pool.register(SpareSlot(slot_id="local:local-1:0", node="local-1", gpu=0))
        assert (await pool.slot("local:local-1:0"))["state"] == "idle"
        assert pool.quarantines() == []
        assert len(tap.of(IncidentOpened)) == 1
        assert {e.generation for e in tap.of(GenerationChanged, job_id="j1")} == {1, 2}


async def test_a_migration_request_does_not_wait_behind_a_burst_of_agent_reports(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
) -> None:
    job = SimJob(bus, "jhol")
    async with control_plane(nats_url, redis_url):
        gen1 = await job.start()
        # A big job's survivors all report the failed collective at once; the executor
        # only reads them (it acts on JOINED and RESUMED), each with a dedupe round trip.
        await job.report_burst(3000, "cf")
        await bus.publish(job.fault(rank=1), Subjects.FAULT_DETECTED)
        gen2 = await job.generation(2)
        reports = await bus.js.consumer_info(EVENTS_STREAM.name, REPORTS_DURABLE)
        # Generation 2 was out while the reports published before the fault still waited.
        assert reports.num_pending + reports.num_ack_pending > 0, reports
        assert gen2.ranks[1].member_id == "jhol-s0"
        await job.resumed(gen2)
        closed = await incident_closed(tap, "jhol")
        assert closed.incident.resolution == Resolution.MIGRATED_LIVE
        assert gen1.generation == 1
        # The reports it does not act on were acked without the dedupe store's round trips;
        # the RESUMED ones it acted on are remembered.
        cf = make_event_id("cf", "jhol", 7)
        assert not await redis.exists(f"tr:migration_executor:seen:{cf}")
        resumed = make_event_id("resumed", gen2.ranks[0].member_id, 2)
        assert await redis.exists(f"tr:migration_executor:seen:{resumed}")
        await job.reports_drained()


async def test_a_job_that_finishes_on_the_new_generation_closes_live_though_its_end_came_first(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
) -> None:
    job = SimJob(bus, "jend")
    async with control_plane(nats_url, redis_url):
        await job.start()
        await bus.publish(job.fault(rank=2), Subjects.FAULT_DETECTED)
        gen2 = await job.generation(2)
        # The ranks resume and the job runs to its end; their RESUMED reports wait on the
        # reports consumer behind a burst, so the executor learns of the end first.
        await job.report_burst(3000, "cf-end")
        await job.resumed(gen2)
        await job.finished("succeeded", 0)
        inc = (await incident_closed(tap, "jend")).incident
        assert inc.resolution == Resolution.MIGRATED_LIVE
        assert tap.of(MigrationFailed, job_id="jend") == []
        await job.reports_drained()


async def test_row_remap_warning_moves_at_the_boundary(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j2")
    async with control_plane(nats_url, redis_url):
        await job.start()
        # An XID 63 on the GPU of rank 3 (local-1, gpu 1): a node-agent fault, no job named.
        warn = job.fault(
            FaultKind.ROW_REMAP_PENDING,
            node="local-1",
            gpu=1,
            severity=Severity.WARNING,
            action=FaultAction.MIGRATE_AT_BOUNDARY,
        )
        await bus.publish(warn, Subjects.FAULT_DETECTED)
        gen2 = await job.generation(2)
        assert gen2.mode == MigrationMode.BOUNDARY
        assert gen2.ranks[3].member_id == "j2-s0"
        await job.resumed(gen2)
        inc = (await incident_closed(tap, "j2")).incident
        assert inc.resolution == Resolution.MIGRATED_PROACTIVE
        assert inc.lost_steps == 0
        assert inc.fault_kind == FaultKind.ROW_REMAP_PENDING


async def test_drain_moves_every_rank_off_the_node(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j3", spares=2)
    async with control_plane(nats_url, redis_url):
        await job.start()
        reply = await bus.request(Subjects.rpc("scheduler", "drain"), {"node": "local-1"})
        assert sorted(r["rank"] for r in reply["ranks"]) == [1, 3]
        # One migration at a time per job: each generation answers once everyone resumed.
        gen2 = await job.generation(2)
        assert gen2.mode == MigrationMode.BOUNDARY
        await job.resumed(gen2)
        gen3 = await job.generation(3)
        await job.resumed(gen3)
        assert {a.node for a in gen3.ranks} == {"local-0", "local-2"}

        async def both_closed() -> bool:
            return len(tap.of(MigrationCompleted, job_id="j3")) == 2

        await wait_until(both_closed, what="two completed migrations")
        closed = await _closed(tap, "j3", 2)
        assert {c.incident.resolution for c in closed} == {Resolution.MIGRATED_PROACTIVE}
        assert {c.incident.fault_kind for c in closed} == {FaultKind.PLANNED_DRAIN}
        # The node is out of service for its maintenance (no spare is taken there) until
        # the operator returns it; the saga itself quarantines nothing for a drain.
        await pool.register(SpareSlot(slot_id="local:local-1:7", node="local-1", gpu=7))
        assert (await pool.slot("local:local-1:7"))["state"] == "quarantined"
        await bus.request(Subjects.rpc("spare_pool", "return"), {"node": "local-1"})
        assert (await pool.slot("local:local-1:7"))["state"] == "idle"
        assert all(q.reason.startswith("planned drain") for q in pool.quarantines())
        assert sorted(f.member_id for f in job.fences) == ["j3-w1", "j3-w3"]


async def _closed(tap: EventTap, job_id: str, n: int) -> list[Any]:
    async def check() -> list[IncidentClosed] | None:
        found = [e for e in tap.of(IncidentClosed) if e.incident.job_id == job_id]
        return found if len(found) >= n else None

    result: list[Any] = await wait_until(check, what=f"{n} closed incidents of {job_id}")
    return result


async def test_no_spare_with_checkpoint_restart_policy_falls_back(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j4", spares=0, policy=JobPolicy.CHECKPOINT_RESTART)
    async with control_plane(nats_url, redis_url):
        await job.start()
        await bus.publish(job.fault(rank=2), Subjects.FAULT_DETECTED)
        failed = await tap.wait(MigrationFailed, job_id="j4")
        assert failed.fallback == Resolution.CHECKPOINT_RESTART
        inc = (await incident_closed(tap, "j4")).incident
        assert inc.resolution == Resolution.CHECKPOINT_RESTART
        assert (await bus.get_generation("j4"))[0].generation == 1  # type: ignore[index]
        assert tap.of(MigrationCompleted) == []


async def test_wait_policy_uses_a_spare_registered_during_the_wait(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j5", spares=0, policy=JobPolicy.WAIT, wait_timeout_s=30)
    async with control_plane(nats_url, redis_url):
        await job.start()
        await bus.publish(job.fault(rank=0), Subjects.FAULT_DETECTED)

        async def waiting() -> bool:
            sagas = await bus.request(
                Subjects.rpc("migration_executor", "saga_list"), {"job_id": "j5"}
            )
            return [s["phase"] for s in sagas["items"]] == ["wait_spare"]

        await wait_until(waiting, what="the saga waiting for a spare")
        # An operator brings a spare: the launcher registers it, its agent joins.
        spare = job.spare(0)
        await pool.register(job.spare_slot(0))
        await job.joined(spare)
        gen2 = await job.generation(2)
        assert gen2.ranks[0].member_id == "j5-s0"
        assert gen2.store_member == "j5-w1"  # the store left the failed rank 0
        await job.resumed(gen2, {"j5-w1": {"stall_ms": 1200.0}})
        inc = (await incident_closed(tap, "j5")).incident
        assert inc.resolution == Resolution.MIGRATED_LIVE
        assert inc.stall_ms == 1200.0


async def test_wait_policy_gives_up_after_its_bound(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j5b", spares=0, policy=JobPolicy.WAIT, wait_timeout_s=1.0)
    async with control_plane(nats_url, redis_url):
        await job.start()
        await bus.publish(job.fault(rank=0), Subjects.FAULT_DETECTED)
        inc = (await incident_closed(tap, "j5b")).incident
        assert inc.resolution == Resolution.CHECKPOINT_RESTART


async def test_shrink_policy_writes_a_smaller_generation(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j6", spares=0, policy=JobPolicy.SHRINK, allow_shrink=True)
    async with control_plane(nats_url, redis_url):
        await job.start()
        await bus.publish(job.fault(rank=1), Subjects.FAULT_DETECTED)
        gen2 = await job.generation(2)
        assert gen2.world_size == 3
        assert [a.member_id for a in gen2.ranks] == ["j6-w0", "j6-w2", "j6-w3"]
        inc = (await incident_closed(tap, "j6")).incident
        assert inc.resolution == Resolution.SHRUNK
        assert inc.generation_after == 2


async def test_a_job_shrunk_to_one_rank_falls_back_instead_of_shrinking_again(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    """A job shrunk to one rank cannot shrink again: its next failure falls back to the
    restart. The failure names the failed rank's slot and fault (what the launcher's
    restart leaves out)."""
    job = SimJob(bus, "j6b", world_size=2, spares=0, policy=JobPolicy.SHRINK, allow_shrink=True)
    async with control_plane(nats_url, redis_url):
        await job.start()
        await bus.publish(job.fault(rank=1), Subjects.FAULT_DETECTED)
        gen2 = await job.generation(2)
        assert [a.member_id for a in gen2.ranks] == ["j6b-w0"]
        await bus.publish(job.fault(rank=0), Subjects.FAULT_DETECTED)
        failed = await tap.wait(
            MigrationFailed, job_id="j6b", fallback=Resolution.CHECKPOINT_RESTART
        )
        slot = job.worker(0)
        assert (failed.node, failed.gpu) == (slot.node, slot.gpu)
        assert failed.fault_kind == FaultKind.WORKER_LOST
        assert (await bus.get_generation("j6b"))[0].generation == 2  # type: ignore[index]


async def test_spare_that_never_resumes_is_replaced_by_the_next(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j7", spares=2)
    async with control_plane(nats_url, redis_url, resume_timeout_s=1.5):
        await job.start()
        await bus.publish(job.fault(rank=2), Subjects.FAULT_DETECTED)
        gen2 = await job.generation(2)
        first = gen2.ranks[2].member_id
        # The survivors resume; the spare never does (it died on the way).
        await job.resumed(gen2, only={a.member_id for a in gen2.ranks} - {first})
        gen3 = await job.generation(3)
        second = gen3.ranks[2].member_id
        assert second not in (first, "j7-w2")
        assert gen3.departing == [first]
        await job.resumed(gen3)
        inc = (await incident_closed(tap, "j7")).incident
        assert inc.resolution == Resolution.MIGRATED_LIVE
        assert (inc.generation_before, inc.generation_after) == (2, 3)
        assert len(pool.releases()) == 1  # the first spare's lease was handed back
        assert await pool.in_state("reserved") == []
        assert [(q.node, q.gpu) for q in pool.quarantines()] == [("local-2", 0)]
        assert sorted(f.member_id for f in job.fences) == sorted([first, "j7-w2"])


async def test_cold_slot_is_started_by_the_launcher(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j8", spares=0)
    async with control_plane(nats_url, redis_url):
        await pool.register(SpareSlot(slot_id="local:local-3:0", node="local-3", gpu=0))
        await job.start()
        await bus.publish(job.fault(rank=3), Subjects.FAULT_DETECTED)
        gen2 = await job.generation(2)
        assert job.spawned == [
            {"node": "local-3", "gpu": 0, "slot_id": "local:local-3:0", "member_id": "j8-s0"}
        ]
        assert gen2.ranks[3].member_id == "j8-s0"
        await job.resumed(gen2)
        assert (await incident_closed(tap, "j8")).incident.resolution == Resolution.MIGRATED_LIVE


async def test_application_error_is_recorded_not_migrated(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j9")
    async with control_plane(nats_url, redis_url):
        await job.start()
        await bus.publish(
            job.fault(FaultKind.APPLICATION_ERROR, rank=0, action=FaultAction.RECORD),
            Subjects.FAULT_DETECTED,
        )
        inc = (await incident_closed(tap, "j9")).incident
        assert inc.resolution == Resolution.EXCLUDED
        assert tap.of(MigrationRequested) == []
        assert pool.reservations() == []


async def test_repeated_requests_and_faults_start_one_migration(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j10", spares=2)
    async with control_plane(nats_url, redis_url):
        await job.start()
        fault = job.fault(rank=1)
        await bus.publish(fault, Subjects.FAULT_DETECTED)
        request = await tap.wait(MigrationRequested, job_id="j10")
        gen2 = await job.generation(2)
        # The same request again under a new message id (a scheduler retry past the
        # duplicate window), and the same fault re-sent, and another fault on the member.
        await bus.publish(
            request.model_copy(update={"event_id": "again-1"}), Subjects.MIGRATION_REQUESTED
        )
        await bus.publish(fault.model_copy(update={"event_id": "again-2"}), Subjects.FAULT_DETECTED)
        await job.resumed(gen2)
        await incident_closed(tap, "j10")
        sagas = await bus.request(
            Subjects.rpc("migration_executor", "saga_list"), {"job_id": "j10"}
        )
        assert len(sagas["items"]) == 1
        assert sagas["items"][0]["phase"] == "done"
        assert len(tap.of(MigrationRequested, job_id="j10")) == 2  # the original + our copy
        assert len(tap.of(MigrationCompleted, job_id="j10")) == 1
        assert len(pool.reservations()) == 1
        assert (await bus.get_generation("j10"))[0].generation == 2  # type: ignore[index]
        incidents = await bus.request(Subjects.rpc("scheduler", "incident_list"), {"job_id": "j10"})
        assert len(incidents["items"]) == 1


async def test_second_failure_during_a_migration_is_not_held_up_by_it(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j11", spares=2)
    async with control_plane(nats_url, redis_url, resume_timeout_s=60.0):
        await job.start()
        await bus.publish(job.fault(rank=1), Subjects.FAULT_DETECTED)
        gen2 = await job.generation(2)
        # Rank 3 dies too before anyone resumed in generation 2: its migration goes on top
        # at once (no waiting out generation 2's deadline), and the agents, who skip
        # straight to generation 3, resume only there.
        await bus.publish(job.fault(rank=3), Subjects.FAULT_DETECTED)
        gen3 = await job.generation(3, timeout=10)
        assert gen3.ranks[1].member_id == gen2.ranks[1].member_id
        assert gen3.ranks[3].member_id not in ("j11-w3", gen2.ranks[1].member_id)
        await job.resumed(gen3, {"j11-w0": {"stall_ms": 90.0, "lost_steps": 1}})
        closed = await _closed(tap, "j11", 2)
        assert {c.incident.resolution for c in closed} == {Resolution.MIGRATED_LIVE}
        assert {c.incident.rank for c in closed} == {1, 3}
        assert {c.incident.stall_ms for c in closed} == {90.0}
        assert await pool.in_state("reserved") == []


async def test_drain_never_moves_a_rank_onto_a_spare_of_the_drained_node(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j12", spares=1, policy=JobPolicy.CHECKPOINT_RESTART)
    on_drained = Member(member_id="j12-s1", role=Role.SPARE, node="local-1", gpu=5, pid=2100)
    async with control_plane(nats_url, redis_url):
        await job.start()
        await pool.register(
            SpareSlot(
                slot_id="local:local-1:5",
                node="local-1",
                gpu=5,
                state="hot",
                job_id="j12",
                member_id="j12-s1",
            )
        )
        await job.joined(on_drained)
        await bus.request(Subjects.rpc("scheduler", "drain"), {"node": "local-1"})
        gen2 = await job.generation(2)
        await job.resumed(gen2)
        closed = await _closed(tap, "j12", 2)
        by_rank = {c.incident.rank: c.incident.resolution for c in closed}
        # One rank went to the spare on local-2; for the other only the drained node's own
        # spare was left, and it was not used: the job's policy took over.
        assert sorted(by_rank.values()) == [
            Resolution.CHECKPOINT_RESTART,
            Resolution.MIGRATED_PROACTIVE,
        ]
        final = (await bus.get_generation("j12"))[0]  # type: ignore[index]
        assert final.generation == 2
        assert "j12-s1" not in {a.member_id for a in final.ranks}
        assert (await pool.slot("local:local-1:5"))["state"] == "quarantined"


async def test_a_spare_dying_before_it_resumed_is_replaced_and_both_failures_close_live(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j13", spares=2)
    async with control_plane(nats_url, redis_url, resume_timeout_s=60.0):
        await job.start()
        await bus.publish(job.fault(rank=1), Subjects.FAULT_DETECTED)
        gen2 = await job.generation(2)
        first = gen2.ranks[1]
        # The spare dies on its way in: the detector reports it (it holds rank 1 now).
        await bus.publish(
            FaultDetected(
                event_id="spare-died",
                source="detector",
                fault_id="spare-died",
                cluster="local",
                node=first.node,
                gpu=first.gpu,
                job_id="j13",
                rank=1,
                member_id=first.member_id,
                kind=FaultKind.WORKER_LOST,
                severity=Severity.FATAL,
                action=FaultAction.MIGRATE_NOW,
            ),
            Subjects.FAULT_DETECTED,
        )
        gen3 = await job.generation(3, timeout=10)
        second = gen3.ranks[1]
        assert second.member_id not in (first.member_id, "j13-w1")
        await job.resumed(gen3, {"j13-w2": {"stall_ms": 120.0}})
        closed = await _closed(tap, "j13", 2)
        assert [c.incident.resolution for c in closed] == [Resolution.MIGRATED_LIVE] * 2
        by_fault = {c.incident.fault_id: c.incident for c in closed}
        original = next(i for f, i in by_fault.items() if f != "spare-died")
        assert original.generation_after == 3  # where the rank came back to life
        done = {e.incident_id: e for e in tap.of(MigrationCompleted)}
        assert (done[original.incident_id].to_node, done[original.incident_id].to_gpu) == (
            second.node,
            second.gpu,
        )
        assert await pool.in_state("reserved") == []
        assert (await pool.slot(f"local:{second.node}:{second.gpu}"))["state"] == "in_use"


async def test_a_fatal_fault_on_the_leaving_rank_makes_a_boundary_migration_immediate(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j14")
    async with control_plane(nats_url, redis_url, resume_timeout_s=60.0):
        await job.start()
        warn = job.fault(
            FaultKind.ROW_REMAP_PENDING,
            node="local-1",
            gpu=1,
            severity=Severity.WARNING,
            action=FaultAction.MIGRATE_AT_BOUNDARY,
        )
        await bus.publish(warn, Subjects.FAULT_DETECTED)
        gen2 = await job.generation(2)
        assert gen2.mode == MigrationMode.BOUNDARY
        # Before the step boundary comes, the leaving rank's process dies: the step in
        # flight can never finish, so the switch must not wait for it.
        await bus.publish(job.fault(rank=3), Subjects.FAULT_DETECTED)
        gen3 = await job.generation(3, timeout=10)
        assert gen3.mode == MigrationMode.IMMEDIATE
        assert [a.member_id for a in gen3.ranks] == [a.member_id for a in gen2.ranks]
        assert gen3.migration_id == gen2.migration_id
        await job.resumed(gen3, {"j14-w0": {"stall_ms": 75.0, "lost_steps": 1}})
        inc = (await incident_closed(tap, "j14")).incident
        assert inc.resolution == Resolution.MIGRATED_LIVE  # a failure, resolved live
        assert (inc.generation_after, inc.lost_steps) == (3, 1)
        assert len(tap.of(IncidentOpened)) == 1
        got = await bus.request(
            Subjects.rpc("scheduler", "incident_get"), {"incident_id": inc.incident_id}
        )
        assert [f["kind"] for f in got["folded_faults"]] == ["worker_lost"]
        assert got["mode"] == "immediate"


async def test_a_job_that_ends_during_the_wait_closes_its_incident_as_lost(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j15", spares=0, policy=JobPolicy.WAIT, wait_timeout_s=60)
    async with control_plane(nats_url, redis_url):
        await job.start()
        await bus.publish(job.fault(rank=2), Subjects.FAULT_DETECTED)

        async def waiting() -> bool:
            sagas = await bus.request(
                Subjects.rpc("migration_executor", "saga_list"), {"job_id": "j15"}
            )
            return [s["phase"] for s in sagas["items"]] == ["wait_spare"]

        await wait_until(waiting, what="the saga waiting for a spare")
        # The launcher gives up on the job (its own bound) before a spare comes.
        await job.finished("failed", 1)
        inc = (await incident_closed(tap, "j15")).incident
        assert inc.resolution == Resolution.LOST
        failed = await tap.wait(MigrationFailed, job_id="j15")
        assert "finished" in failed.reason


async def test_a_lost_gpu_is_migrated_live_and_its_slot_quarantined(
    bus: Bus,
    redis: aioredis.Redis,
    nats_url: str,
    redis_url: str,
    tap: EventTap,
    pool: SparePoolView,
) -> None:
    job = SimJob(bus, "j16")
    async with control_plane(nats_url, redis_url):
        await job.start()
        # XID 79 on the GPU of rank 2 (local-0, gpu 1), from the node agent: no job named.
        await bus.publish(
            job.fault(FaultKind.GPU_LOST, node="local-0", gpu=1, action=FaultAction.QUARANTINE),
            Subjects.FAULT_DETECTED,
        )
        gen2 = await job.generation(2)
        assert gen2.mode == MigrationMode.IMMEDIATE
        assert gen2.ranks[2].member_id == "j16-s0"
        await job.resumed(gen2)
        inc = (await incident_closed(tap, "j16")).incident
        assert (inc.resolution, inc.fault_kind) == (Resolution.MIGRATED_LIVE, FaultKind.GPU_LOST)
        # The GPU is out of service: a spare offered there starts quarantined.
        await pool.register(SpareSlot(slot_id="local:local-0:1", node="local-0", gpu=1))
        assert (await pool.slot("local:local-0:1"))["state"] == "quarantined"
