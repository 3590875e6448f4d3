"""The scheduler's goodput verbs against real NATS and Redis, the test playing agents,
launcher and executor with hand-set times, so every figure is known in advance."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
import redis.asyncio as aioredis

from services.billing.ledger import Ledger
from services.billing.service import setup as billing_setup
from tests.helpers.inproc import service_settings, start_in_process
from tests.integration.migration_executor.harness import (
    EventTap,
    SimJob,
    control_plane,
    scheduler_rpc,
    wait_until,
)
from torchrelay.bus import Bus, RpcFailed
from torchrelay.contract import (
    GenerationChanged,
    Heartbeat,
    IncidentAmended,
    IncidentClosed,
    JobFinished,
    JobPolicy,
    JobRestarted,
    Member,
    MigrationCompleted,
    MigrationFailed,
    MigrationMode,
    MigrationRequested,
    RankAssignment,
    Resolution,
    Role,
    Subjects,
    make_event_id,
    utcnow,
)

pytestmark = pytest.mark.slow


def ranks(job: SimJob, spare_for: int | None = None) -> list[RankAssignment]:
    out = []
    for i in range(job.world_size):
        m = job.spare(0) if i == spare_for else job.worker(i)
        out.append(RankAssignment(rank=i, member_id=m.member_id, node=m.node, gpu=m.gpu))
    return out


async def generation(bus: Bus, job: SimJob, number: int, at: datetime, **kw: object) -> None:
    await bus.publish(
        GenerationChanged(
            event_id=make_event_id("generation", job.job_id, number),
            source="test",
            occurred_at=at,
            job_id=job.job_id,
            generation=number,
            previous=number - 1,
            ranks=kw.pop("ranks", ranks(job)),  # type: ignore[arg-type]
            reason=str(kw.pop("reason", "formed")),
        ),
        Subjects.GENERATION_CHANGED,
    )

    async def applied() -> bool:
        view = await scheduler_rpc(bus, "job_get", {"job_id": job.job_id})
        return view["generation"] == number

    await wait_until(applied, what=f"generation {number} applied")


async def step_beats(
    bus: Bus, job: SimJob, member: str, times: list[float], generation: int = 1
) -> None:
    for n, step_time in enumerate(times):
        await bus.publish_core(
            Subjects.heartbeat(job.job_id),
            Heartbeat(
                event_id=f"hb-{member}-{n}",
                source="agent",
                job_id=job.job_id,
                member_id=member,
                rank=0,
                generation=generation,
                step=n,
                step_time_s=step_time,
                node="local-0",
                gpu=0,
                pid=1000,
            ),
        )


async def test_a_migrated_jobs_goodput_is_its_allocation_less_the_incidents_loss(
    bus: Bus, redis: aioredis.Redis, nats_url: str, redis_url: str, tap: EventTap
) -> None:
    del redis  # flushed before the services start
    t0 = utcnow().replace(microsecond=0) - timedelta(seconds=300)
    job = SimJob(bus, "gp1")
    async with control_plane(nats_url, redis_url, executor=False):
        await job.register()
        await generation(bus, job, 1, t0)
        # The agents' step times: a mean of 0.5 s over eight step beats (liveness beats and
        # a launcher's beats do not count).
        await step_beats(bus, job, "gp1-w0", [0.25] * 4 + [0.75] * 4)

        fault = job.fault(rank=1).model_copy(update={"first_seen_at": t0 + timedelta(seconds=60)})
        await bus.publish(fault, Subjects.FAULT_DETECTED)
        request = await tap.wait(MigrationRequested, job_id="gp1")
        await generation(
            bus, job, 2, t0 + timedelta(seconds=62), ranks=ranks(job, 1), reason="migration"
        )
        await bus.publish(
            MigrationCompleted(
                event_id="done-gp1",
                source="migration_executor",
                migration_id=request.migration_id,
                incident_id=request.incident_id,
                job_id="gp1",
                rank=1,
                mode=MigrationMode.IMMEDIATE,
                to_node="local-2",
                to_gpu=0,
                generation_before=1,
                generation_after=2,
                stall_ms=2000.0,
                lost_steps=2,
                bytes_moved=1,
            ),
            Subjects.MIGRATION_COMPLETED,
        )
        await tap.wait(IncidentClosed)
        await bus.publish(
            JobFinished(
                event_id="fin-gp1",
                source="launcher",
                occurred_at=t0 + timedelta(seconds=300),
                job_id="gp1",
                tenant="acme",
                outcome="succeeded",
                committed_step=500,
            ),
            Subjects.JOB_FINISHED,
        )

        async def measured() -> dict[str, object] | None:
            g = await scheduler_rpc(
                bus, "job_goodput", {"job_id": "gp1", "restart_s": 60, "checkpoint_every": 100}
            )
            return g if g["state"] == "succeeded" and g["step_time_s"] == 0.5 else None

        g = await wait_until(measured, what="the job finished with its step times")
        assert g["gpu_seconds_allocated"] == 4 * 300
        (incident,) = g["incidents"]
        assert incident["incident_id"] == request.incident_id
        assert incident["stall_gpu_seconds"] == 4 * 2.0
        assert incident["lost_steps_gpu_seconds"] == 4 * 2 * 0.5
        assert g["gpu_seconds_lost"] == 12.0
        assert g["gpu_seconds_progress"] == 1200 - 12
        assert g["ettr"] == pytest.approx(1188 / 1200)
        assert g["committed_step"] == 500
        cf = g["counterfactual"]
        assert cf["gpu_seconds_lost"] == 4 * (60 + 50 * 0.5)
        assert cf["gpu_seconds_saved"] == 340 - 12

        # The tenant's sum over a window that holds the first half of the job only.
        t = await scheduler_rpc(
            bus,
            "tenant_goodput",
            {
                "tenant": "acme",
                "from": t0.isoformat(),
                "to": (t0 + timedelta(seconds=150)).isoformat(),
            },
        )
        assert t["gpu_seconds_allocated"] == 4 * 150
        assert t["gpu_seconds_lost"] == 12.0
        assert [j["job_id"] for j in t["jobs"]] == ["gp1"]  # type: ignore[union-attr]
        later = await scheduler_rpc(
            bus,
            "tenant_goodput",
            {"tenant": "acme", "from": (t0 + timedelta(seconds=400)).isoformat()},
        )
        assert (later["gpu_seconds_allocated"], later["jobs"]) == (0.0, [])

        with pytest.raises(RpcFailed) as missing:
            await scheduler_rpc(bus, "job_goodput", {"job_id": "nope"})
        assert missing.value.error.code == "not_found"


async def test_a_restarts_lost_steps_and_stall_reach_the_ledger_and_goodput_alike(
    bus: Bus, redis: aioredis.Redis, nats_url: str, redis_url: str, tap: EventTap
) -> None:
    t0 = utcnow().replace(microsecond=0) - timedelta(seconds=200)
    job = SimJob(bus, "gp2", policy=JobPolicy.CHECKPOINT_RESTART, spares=0)
    billing = await start_in_process(
        "billing", billing_setup, service_settings(nats_url, redis_url)
    )
    try:
        async with control_plane(nats_url, redis_url, executor=False):
            await bus.request(
                Subjects.rpc("billing", "contract_create"),
                {
                    "tenant": "acme",
                    "term_start": (t0 - timedelta(days=1)).isoformat(),
                    "term_end": (t0 + timedelta(days=30)).isoformat(),
                    "renewal_fee_minor": 1000,
                    "currency": "USD",
                },
            )
            await job.register()
            await generation(bus, job, 1, t0)
            await step_beats(bus, job, "gp2-w0", [0.5] * 4)
            fault = job.fault(rank=2).model_copy(
                update={"first_seen_at": t0 + timedelta(seconds=60)}
            )
            await bus.publish(fault, Subjects.FAULT_DETECTED)
            request = await tap.wait(MigrationRequested, job_id="gp2")
            await bus.publish(
                MigrationFailed(
                    event_id="failed-gp2",
                    source="migration_executor",
                    migration_id=request.migration_id,
                    incident_id=request.incident_id,
                    job_id="gp2",
                    reason="no spare",
                    fallback=Resolution.CHECKPOINT_RESTART,
                ),
                Subjects.MIGRATION_FAILED,
            )
            closed = await tap.wait(IncidentClosed)
            assert closed.incident.lost_steps is None  # not known at the close
            restarted = [
                Member(
                    member_id=f"gp2-r1-w{i}", role=Role.WORKER, node=f"local-{i % 2}", gpu=i // 2
                )
                for i in range(4)
            ]
            await bus.publish(
                JobRestarted(
                    event_id="restart-gp2",
                    source="launcher",
                    job_id="gp2",
                    tenant="acme",
                    restart=1,
                    incident_id=request.incident_id,
                    migration_id=request.migration_id,
                    world_size=4,
                    members=restarted,
                    checkpoint="ck/step-100",
                    checkpoint_steps=100,
                    committed_steps=137,
                    lost_steps=37,
                ),
                Subjects.JOB_RESTARTED,
            )
            await tap.wait(IncidentAmended)
            new_ranks = [
                RankAssignment(rank=i, member_id=m.member_id, node=m.node, gpu=m.gpu)
                for i, m in enumerate(restarted)
            ]
            await generation(bus, job, 2, t0 + timedelta(seconds=150), ranks=new_ranks)
            await step_beats(bus, job, "gp2-r1-w0", [0.5] * 4, generation=2)

            ledger = Ledger(redis)
            contract_id = (await ledger.contract_for("acme", t0)).contract_id  # type: ignore[union-attr]

            async def amended_twice() -> list[dict[str, object]] | None:
                entries = await ledger.entries(contract_id)
                return entries if len(entries) == 3 else None

            entries = await wait_until(amended_twice, what="both amendments in the ledger")
            assert [e["kind"] for e in entries] == ["incident", "amendment", "amendment"]
            assert [e["fields"] for e in entries[1:]] == [["lost_steps"], ["stall_ms"]]
            in_ledger = entries[2]["incident"]
            assert in_ledger["lost_steps"] == 37  # type: ignore[index]
            verified = await bus.request(Subjects.rpc("billing", "ledger_verify"), {})
            assert verified == {"ok": True, "checked": 3, "chains": 1}

            await bus.publish(
                JobFinished(
                    event_id="fin-gp2",
                    source="launcher",
                    occurred_at=t0 + timedelta(seconds=400),
                    job_id="gp2",
                    tenant="acme",
                    outcome="succeeded",
                ),
                Subjects.JOB_FINISHED,
            )

            async def finished() -> dict[str, object] | None:
                g = await scheduler_rpc(bus, "job_goodput", {"job_id": "gp2"})
                return g if g["state"] == "succeeded" and g["step_time_s"] == 0.5 else None

            g = await wait_until(finished, what="the restarted job finished")
            (incident,) = g["incidents"]  # type: ignore[misc]
            # Goodput reads the same stall and lost steps as the ledger's newest entry.
            assert (incident["stall_ms"], incident["lost_steps"]) == (
                in_ledger["stall_ms"],  # type: ignore[index]
                37,
            )
            stall_s = float(in_ledger["stall_ms"]) / 1000  # type: ignore[index]
            assert 90 < stall_s < 200  # from the fault at t0+60 s to the beat just sent
            assert incident["stall_gpu_seconds"] == round(4 * stall_s, 3)
            assert incident["lost_steps_gpu_seconds"] == 4 * 37 * 0.5
            assert g["gpu_seconds_allocated"] == 4 * 400
            lost = incident["gpu_seconds_lost"]
            assert abs(g["gpu_seconds_allocated"] - g["gpu_seconds_progress"] - lost) < 0.0015
            # a restart costs the same under the counterfactual: nothing saved on it
            assert g["counterfactual"]["gpu_seconds_saved"] == 0.0  # type: ignore[index]
    finally:
        await billing.stopped(within_s=15)
