"""The scheduler service: faults become incidents and decisions, migrations close them.

Consumes the ``scheduler`` durable consumer (faults, job registrations and finishes, drains,
generations, migration results) and the core-NATS heartbeats (committed steps, in the
``scheduler`` queue group); answers the ``tr.rpc.scheduler.*`` verbs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from datetime import datetime
from typing import Any

from nats.aio.msg import Msg
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ConfigDict, Field

from torchrelay.bus import BusError, Delivery, NotFound, PermanentError
from torchrelay.contract import (
    DrainRequested,
    Event,
    FaultAction,
    FaultDetected,
    FaultKind,
    GenerationChanged,
    Incident,
    IncidentAmended,
    IncidentClosed,
    IncidentOpened,
    JobFinished,
    JobRegistered,
    JobRestarted,
    MigrationCompleted,
    MigrationFailed,
    MigrationMode,
    MigrationRequested,
    Name,
    Resolution,
    Severity,
    Subjects,
    Token,
    make_event_id,
    utcnow,
)
from torchrelay.service import ServiceContext

from . import rules
from .credentials import setup_credentials
from .goodput import GoodputVerbs
from .hosts import setup_hosts
from .incidents import IncidentStore
from .registry import JobRegistry

SERVICE = "scheduler"
_TOKEN = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")  # contract.Token
HEARTBEAT_FLUSH_S = 1.0


class _Page(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    limit: int = Field(default=100, ge=1, le=1000)
    cursor: str | None = Field(default=None, pattern=r"^[0-9]+$")


class JobListQuery(_Page):
    tenant: Token | None = None


class JobQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job_id: Token


class IncidentQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")
    incident_id: str = Field(min_length=1, max_length=128)


class IncidentListQuery(_Page):
    job_id: Token | None = None
    tenant: Token | None = None
    resolution: Resolution | None = None
    since: datetime | None = Field(default=None, alias="from")
    until: datetime | None = Field(default=None, alias="to")


class DrainCommand(BaseModel):
    model_config = ConfigDict(extra="forbid")
    node: Name
    cluster: Name | None = None
    reason: str = Field(default="planned maintenance", max_length=500)
    requested_by: str = Field(default="operator", max_length=128)


def _page(items: list[Any], query: _Page) -> dict[str, Any]:
    start = int(query.cursor or 0)
    end = start + query.limit
    return {"items": items[start:end], "next_cursor": str(end) if end < len(items) else None}


class Scheduler:
    """Handlers and RPC verbs of the scheduler, over its Redis state."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.jobs = JobRegistry(ctx.redis, ctx.prefix)
        self.incidents = IncidentStore(ctx.redis, ctx.prefix)
        self._steps: dict[str, int] = {}
        # Restarted jobs whose first step is awaited: job -> (incident, the new members).
        self._restarting: dict[str, tuple[str, frozenset[str]]] = {}
        self._pids: dict[str, dict[str, int]] = {}
        # The agents' step times since the last flush: job -> (sum of seconds, step beats).
        self._step_times: dict[str, tuple[float, int]] = {}
        self.incidents_total = Counter(
            "incidents_total",
            "Incidents closed, by resolution and fault kind",
            ["resolution", "fault_kind"],
            registry=ctx.metrics.registry,
        )
        self.migration_stall_seconds = Histogram(
            "migration_stall_seconds",
            "Survivors' longest step gap around a migration",
            ["resolution"],
            registry=ctx.metrics.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
        )

    # ------------------------------------------------------------------ events

    async def on_event(self, event: Event, delivery: Delivery) -> None:
        """Dispatch one event of the ``scheduler`` consumer."""
        del delivery
        if isinstance(event, FaultDetected):
            await self.on_fault(event)
        elif isinstance(event, JobRegistered):
            await self.jobs.register(event)
        elif isinstance(event, JobFinished):
            await self.jobs.finish(event)
        elif isinstance(event, GenerationChanged):
            await self.jobs.apply_generation(event)
        elif isinstance(event, DrainRequested):
            await self.on_drain(event)
        elif isinstance(event, MigrationCompleted):
            await self.on_completed(event)
        elif isinstance(event, MigrationFailed):
            await self.on_failed(event)
        elif isinstance(event, JobRestarted):
            await self.on_restarted(event)
        else:
            raise PermanentError(f"scheduler does not handle {type(event).__name__}")

    async def on_fault(self, fault: FaultDetected) -> None:
        """Open one incident per hurt rank (or fold into the open one) and act on it."""
        decision = rules.decide(fault.kind, fault.severity, fault.action)
        if fault.job_id is not None:
            reading = self.jobs.active_placements(job_id=fault.job_id)
        else:
            reading = self.jobs.active_placements(cluster=fault.cluster, node=fault.node)
        if decision == rules.Decision.MIGRATE_NOW:
            # Before the per-rank path: whichever sees the fault first folds it, once. It
            # touches only a leaving member's incident: read the placements meanwhile.
            placements, _ = await asyncio.gather(reading, self._fold_into_leaving(fault))
        else:
            placements = await reading
        hurt = rules.affected_ranks(fault, placements)
        if not hurt:
            self.ctx.log.info(
                "fault hurts no running rank",
                extra={
                    "fault_id": fault.fault_id,
                    "kind": fault.kind.value,
                    "node": fault.node,
                    "job_id": fault.job_id,
                    "member_id": fault.member_id,
                },
            )
            return
        for placement in hurt:
            incident = rules.open_incident(fault, placement)
            extra: dict[str, Any] = {"decision": decision.value}
            if decision != rules.Decision.RECORD:
                # Known before anything is published, so stored with the incident at once.
                extra["migration_id"] = rules.migration_id_for(incident.incident_id)
                extra["mode"] = rules.migration_mode(decision).value
            outcome, incident_id = await self.incidents.open(incident, placement.member_id, extra)
            if outcome == "folded":
                self.ctx.log.info(
                    "fault folded into open incident",
                    extra={"fault_id": fault.fault_id, "incident_id": incident_id},
                )
                if decision == rules.Decision.MIGRATE_NOW:
                    await self._escalate(incident_id, fault)
                continue
            # "opened", or "fault" (a redelivery after a crash): drive the incident's
            # effects again; every publish below has a deterministic id. Just opened, the
            # record is the one written: no need to read it back before the decision goes out.
            opened = (incident, placement.member_id, decision) if outcome == "opened" else None
            await self._drive(incident_id, fault, opened)

    async def _drive(
        self,
        incident_id: str,
        fault: FaultDetected,
        opened: tuple[Incident, str, rules.Decision] | None = None,
    ) -> None:
        if opened is not None:
            incident, member_id, decision = opened
        else:
            record = await self.incidents.record(incident_id)
            if record is None:
                return
            incident = Incident.model_validate(record["incident"])
            member_id = record["member_id"]
            decision = rules.Decision(record["decision"])
        if incident.fault_id != fault.fault_id:
            return  # a redelivered fault that was folded into another fault's incident
        timeline: list[dict[str, Any]] = [
            {
                "type": "incident_opened",
                "incident_id": incident_id,
                "rank": incident.rank,
                "fault_kind": incident.fault_kind.value,
                "decision": decision.value,
            }
        ]
        migrating = (
            incident.resolution == Resolution.OPEN
            and decision != rules.Decision.RECORD
            and bool(incident.generation_before)
        )
        if migrating:
            # The migration request goes first: it is on the path of the job's stall, the
            # bookkeeping below is not.
            mode = rules.migration_mode(decision)
            migration_id = rules.migration_id_for(incident_id)
            assert incident.rank is not None
            assert incident.gpu is not None
            assert incident.generation_before is not None
            await self.ctx.bus.publish(
                MigrationRequested(
                    event_id=make_event_id("migration_requested", migration_id),
                    source=SERVICE,
                    occurred_at=fault.occurred_at,
                    migration_id=migration_id,
                    incident_id=incident_id,
                    job_id=incident.job_id,
                    tenant=incident.tenant,
                    rank=incident.rank,
                    member_id=member_id,
                    node=incident.node,
                    gpu=incident.gpu,
                    mode=mode,
                    fault_kind=incident.fault_kind,
                    generation_before=incident.generation_before,
                ),
                Subjects.MIGRATION_REQUESTED,
            )
            timeline.append(
                {
                    "type": "migration_requested",
                    "migration_id": migration_id,
                    "incident_id": incident_id,
                    "rank": incident.rank,
                    "mode": mode.value,
                }
            )
        await self.ctx.bus.publish(
            IncidentOpened(
                event_id=make_event_id("incident_opened", incident_id),
                source=SERVICE,
                incident=incident,
                occurred_at=fault.occurred_at,
            ),
            Subjects.INCIDENT_OPENED,
        )
        await self.jobs.add_timeline_entries(incident.job_id, fault.occurred_at, timeline)
        if migrating:
            return
        if incident.resolution != Resolution.OPEN:
            await self._publish_closed(incident_id)
        elif decision == rules.Decision.RECORD:
            await self._close(rules.close_recorded(incident, fault.occurred_at))
        else:
            # The job has not formed its first generation: there is nothing to migrate into.
            await self._close(rules.close_unplaced(incident, fault.occurred_at))

    async def _fold_into_leaving(self, fault: FaultDetected) -> None:
        """A fatal fault on a member that is leaving in a boundary migration.

        Once the boundary generation is out, the leaving member no longer holds a rank, so
        the fault hurts no placement; it still belongs to the open incident and makes its
        migration urgent.
        """
        if fault.job_id is not None and fault.member_id is not None:
            found = await self.incidents.open_for_member(fault.job_id, fault.member_id)
            leaving = [found] if found else []
        else:
            leaving = await self.incidents.open_on_slot(fault.cluster, fault.node, fault.gpu)
        for incident_id in leaving:
            incident = await self.incidents.get(incident_id)
            if incident is None:
                continue
            if await self.incidents.fold(
                incident_id, fault.fault_id, fault.kind.value, incident.job_id, incident.rank
            ):
                await self._escalate(incident_id, fault)

    async def _escalate(self, incident_id: str, fault: FaultDetected) -> None:
        """A fatal fault on a rank whose migration waits for a step boundary: do it now.

        The leaving rank is dead or dying, so the step in flight will not complete; the
        executor switches the migration to immediate (same migration id, new message id).
        """
        record = await self.incidents.record(incident_id)
        if record is None or record.get("mode") != MigrationMode.BOUNDARY.value:
            return
        incident = Incident.model_validate(record["incident"])
        if incident.resolution != Resolution.OPEN or not incident.generation_before:
            return
        await self.incidents.set_mode(incident_id, MigrationMode.IMMEDIATE)
        migration_id = record["migration_id"]
        assert incident.rank is not None
        assert incident.gpu is not None
        await self.ctx.bus.publish(
            MigrationRequested(
                event_id=make_event_id("migration_escalated", migration_id),
                source=SERVICE,
                occurred_at=fault.occurred_at,
                migration_id=migration_id,
                incident_id=incident_id,
                job_id=incident.job_id,
                tenant=incident.tenant,
                rank=incident.rank,
                member_id=record["member_id"],
                node=incident.node,
                gpu=incident.gpu,
                mode=MigrationMode.IMMEDIATE,
                fault_kind=incident.fault_kind,
                generation_before=incident.generation_before,
            ),
            Subjects.MIGRATION_REQUESTED,
        )
        await self.jobs.add_timeline(
            incident.job_id,
            fault.occurred_at,
            {
                "type": "migration_escalated",
                "migration_id": migration_id,
                "incident_id": incident_id,
                "fault_kind": fault.kind.value,
                "mode": "immediate",
            },
        )

    async def _close(self, closed: Incident) -> None:
        await self._record_close(closed)
        await self._publish_closed(closed.incident_id)

    async def _record_close(self, closed: Incident) -> None:
        """Store the closed incident; count it in the metrics when this call closed it."""
        if await self.incidents.close(closed):
            self.incidents_total.labels(closed.resolution.value, closed.fault_kind.value).inc()
            if closed.stall_ms is not None:
                self.migration_stall_seconds.labels(closed.resolution.value).observe(
                    closed.stall_ms / 1000.0
                )

    async def _publish_closed(self, incident_id: str) -> None:
        """Publish the stored closed incident (the same content on every retry)."""
        incident = await self.incidents.get(incident_id)
        if incident is None or incident.resolution == Resolution.OPEN:
            return
        at = incident.resolved_at or utcnow()
        await self.ctx.bus.publish(
            IncidentClosed(
                event_id=make_event_id("incident_closed", incident_id),
                source=SERVICE,
                incident=incident,
                occurred_at=at,
            ),
            Subjects.INCIDENT_CLOSED,
        )
        await self.jobs.add_timeline(
            incident.job_id,
            at,
            {
                "type": "incident_closed",
                "incident_id": incident_id,
                "resolution": incident.resolution.value,
                "stall_ms": incident.stall_ms,
                "lost_steps": incident.lost_steps,
            },
        )

    async def _publish_amended(self, incident: Incident | None, field: str, why: str) -> None:
        """Tell billing what a closed incident learnt (the ledger appends an amendment).

        An incident still open gets the field with its close instead. The event id names the
        incident, the field and its value, so a redelivered restart publishes it once.
        """
        if incident is None or incident.resolution == Resolution.OPEN:
            return
        value = getattr(incident, field)
        at = utcnow()
        await self.ctx.bus.publish(
            IncidentAmended(
                event_id=make_event_id("incident_amended", incident.incident_id, field, value),
                source=SERVICE,
                occurred_at=at,
                incident=incident,
                reason=f"{incident.resolution.value}: {field} ({why}) known after the close",
            ),
            Subjects.INCIDENT_AMENDED,
        )
        await self.jobs.add_timeline(
            incident.job_id,
            at,
            {
                "type": "incident_amended",
                "incident_id": incident.incident_id,
                "stall_ms": incident.stall_ms,
                "lost_steps": incident.lost_steps,
            },
        )

    async def on_drain(self, drain: DrainRequested) -> None:
        """Planned maintenance: one proactive migration per rank on the node."""
        fault = FaultDetected(
            event_id=make_event_id("drain_fault", drain.event_id),
            source=SERVICE,
            occurred_at=drain.occurred_at,
            first_seen_at=drain.occurred_at,
            fault_id=make_event_id("drain", drain.event_id),
            cluster=drain.cluster,
            node=drain.node,
            kind=FaultKind.PLANNED_DRAIN,
            severity=Severity.INFO,
            action=FaultAction.MIGRATE_AT_BOUNDARY,
            evidence={"requested_by": drain.requested_by, "reason": drain.reason},
        )
        # The node leaves service first, so no migration off it picks a spare on it; the
        # operator's "return" (API/CLI) brings its slots back after the maintenance.
        try:
            await self.ctx.bus.request(
                Subjects.rpc("spare_pool", "quarantine"),
                {
                    "node": drain.node,
                    "cluster": drain.cluster,
                    "reason": f"planned drain: {drain.reason}",
                },
                timeout=3.0,
            )
        except BusError as exc:  # not_found: no spare there; unreachable: nothing to protect
            self.ctx.log.info("spare pool did not take %s out: %s", drain.node, exc)
        await self.on_fault(fault)

    async def on_completed(self, done: MigrationCompleted) -> None:
        await self.jobs.add_timeline(
            done.job_id,
            done.occurred_at,
            {
                "type": "migration_completed",
                "migration_id": done.migration_id,
                "incident_id": done.incident_id,
                "rank": done.rank,
                "to_node": done.to_node,
                "to_gpu": done.to_gpu,
                "generation_after": done.generation_after,
                "stall_ms": done.stall_ms,
                "lost_steps": done.lost_steps,
            },
        )
        incident = await self.incidents.get(done.incident_id)
        if incident is None:
            raise PermanentError(
                f"migration {done.migration_id} names unknown incident {done.incident_id}"
            )
        if incident.resolution == Resolution.OPEN:
            await self._record_close(rules.close_completed(incident, done))
        await self._publish_closed(done.incident_id)

    async def on_failed(self, failed: MigrationFailed) -> None:
        await self.jobs.add_timeline(
            failed.job_id,
            failed.occurred_at,
            {
                "type": "migration_failed",
                "migration_id": failed.migration_id,
                "incident_id": failed.incident_id,
                "reason": failed.reason,
                "fallback": failed.fallback.value,
            },
        )
        incident = await self.incidents.get(failed.incident_id)
        if incident is None:
            raise PermanentError(
                f"migration {failed.migration_id} names unknown incident {failed.incident_id}"
            )
        if incident.resolution == Resolution.OPEN:
            after = None
            if failed.fallback == Resolution.SHRUNK:
                job = await self.jobs.get(failed.job_id)
                after = int(job["generation"]) if job else None
            await self._record_close(rules.close_failed(incident, failed, after))
        await self._publish_closed(failed.incident_id)

    async def on_restarted(self, event: JobRestarted) -> None:
        """A checkpoint restart: the incident gets its lost steps now, and the time from the
        fault to the restarted job's first step once that step's heartbeat arrives."""
        await self.jobs.add_timeline(
            event.job_id,
            event.occurred_at,
            {
                "type": "job_restarted",
                "restart": event.restart,
                "incident_id": event.incident_id,
                "checkpoint": event.checkpoint,
                "checkpoint_steps": event.checkpoint_steps,
                "committed_steps": event.committed_steps,
                "lost_steps": event.lost_steps,
            },
        )
        if event.incident_id is None:
            return
        amended = await self.incidents.amend(event.incident_id, lost_steps=event.lost_steps)
        await self._publish_amended(amended, "lost_steps", "steps since the checkpoint")
        members = frozenset(m.member_id for m in event.members)
        self._restarting[event.job_id] = (event.incident_id, members)

    async def _restart_stepped(self, job_id: str, at: datetime) -> None:
        """The restarted job committed its first step: the incident's stall ends there."""
        pending = self._restarting.pop(job_id, None)
        if pending is None:
            return
        incident = await self.incidents.get(pending[0])
        if incident is None:
            return
        stall_ms = max(0.0, (at - incident.detected_at).total_seconds() * 1000.0)
        amended = await self.incidents.amend(pending[0], stall_ms=stall_ms)
        await self._publish_amended(amended, "stall_ms", "fault to the restarted job's first step")
        self.migration_stall_seconds.labels(incident.resolution.value).observe(stall_ms / 1000)

    # ------------------------------------------------------------------ heartbeats

    async def on_heartbeat(self, msg: Msg) -> None:
        """Keep the highest committed step per job in memory; a task flushes it.

        Heartbeats are the busiest subject there is (every rank, several times a second),
        so only the three fields used are read, without building the whole model; a beat
        that lacks them or has the wrong types is dropped (they are loss-tolerant).
        """
        try:
            beat = json.loads(msg.data)
            job_id, member_id = beat["job_id"], beat["member_id"]
            step, pid = beat["step"], beat.get("pid")
            if str(beat.get("kind", "step")).startswith("launcher"):
                return  # a host launcher's beat: the detector's business
        except (ValueError, KeyError, TypeError, AttributeError):
            return
        if not (
            isinstance(job_id, str)
            and isinstance(member_id, str)
            and isinstance(step, int)
            and _TOKEN.match(job_id)
            and _TOKEN.match(member_id)
        ):
            return
        if step >= 0 and step > self._steps.get(job_id, -1):
            self._steps[job_id] = step
        step_time = beat.get("step_time_s")
        if beat.get("kind") == "step" and isinstance(step_time, int | float) and step_time >= 0:
            total, count = self._step_times.get(job_id, (0.0, 0))
            self._step_times[job_id] = (total + float(step_time), count + 1)
        pending = self._restarting.get(job_id)
        if pending is not None and member_id in pending[1] and beat.get("kind") == "step":
            await self._restart_stepped(job_id, utcnow())
        if isinstance(pid, int) and pid >= 0:
            self._pids.setdefault(job_id, {})[member_id] = pid

    async def flush_heartbeats(self) -> None:
        """Write the throttled committed steps and process ids to Redis."""
        steps, self._steps = self._steps, {}
        pids, self._pids = self._pids, {}
        step_times, self._step_times = self._step_times, {}
        for job_id, step in steps.items():
            await self.jobs.record_step(job_id, step)
        for job_id, members in pids.items():
            await self.jobs.record_pids(job_id, members)
        for job_id, (total, count) in step_times.items():
            await self.jobs.record_step_times(job_id, total, count)

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_FLUSH_S)
            try:
                await self.flush_heartbeats()
            except Exception:
                self.ctx.log.exception("heartbeat flush failed; retrying")

    # ------------------------------------------------------------------ rpc

    async def job_list(self, body: dict[str, Any]) -> dict[str, Any]:
        query = JobListQuery.model_validate(body)
        start = int(query.cursor or 0)
        wanted = start + query.limit + 1  # one more tells whether a next page exists
        items = []
        for job_id in await self.jobs.list_ids():
            view = await self.jobs.view(job_id)
            if view is None or (query.tenant is not None and view["tenant"] != query.tenant):
                continue
            items.append(view)
            if len(items) >= wanted:
                break
        return _page(items, query)

    async def job_get(self, body: dict[str, Any]) -> dict[str, Any]:
        query = JobQuery.model_validate(body)
        view = await self.jobs.view(query.job_id)
        if view is None:
            raise NotFound(f"job {query.job_id} is not registered", "job_id")
        return view

    async def job_timeline(self, body: dict[str, Any]) -> dict[str, Any]:
        query = JobQuery.model_validate(body)
        view = await self.jobs.view(query.job_id)
        if view is None:
            raise NotFound(f"job {query.job_id} is not registered", "job_id")
        events = await self.jobs.timeline(query.job_id)
        incidents, _ = await self.incidents.query(job_id=query.job_id)
        return {
            "job_id": query.job_id,
            "tenant": view["tenant"],
            "events": events,
            "generations": await self.jobs.generations(query.job_id),
            "incidents": [i.model_dump(mode="json") for i in reversed(incidents)],
            "migrations": [e for e in events if e["type"].startswith("migration_")],
        }

    async def incident_list(self, body: dict[str, Any]) -> dict[str, Any]:
        query = IncidentListQuery.model_validate(body)
        start = int(query.cursor or 0)
        found, more = await self.incidents.query(
            job_id=query.job_id,
            tenant=query.tenant,
            resolution=query.resolution.value if query.resolution else None,
            since=query.since,
            until=query.until,
            offset=start,
            limit=query.limit,
        )
        return {
            "items": [i.model_dump(mode="json") for i in found],
            "next_cursor": str(start + query.limit) if more else None,
        }

    async def incident_get(self, body: dict[str, Any]) -> dict[str, Any]:
        query = IncidentQuery.model_validate(body)
        record = await self.incidents.record(query.incident_id)
        if record is None:
            raise NotFound(f"incident {query.incident_id} does not exist", "incident_id")
        return {
            **record["incident"],
            "member_id": record.get("member_id"),
            "migration_id": record.get("migration_id"),
            "mode": record.get("mode"),
            "decision": record.get("decision"),
            "folded_faults": record.get("folded_faults", []),
        }

    async def drain(self, body: dict[str, Any]) -> dict[str, Any]:
        """Ask for every rank on a node to move at its next step boundary."""
        command = DrainCommand.model_validate(body)
        cluster = command.cluster or self.ctx.settings.cluster
        drain = DrainRequested(
            event_id=make_event_id("drain", cluster, command.node, uuid.uuid4().hex),
            source=SERVICE,
            cluster=cluster,
            node=command.node,
            requested_by=command.requested_by,
            reason=command.reason,
        )
        ranks = [
            {"job_id": p.job_id, "rank": p.rank, "member_id": p.member_id, "gpu": p.gpu}
            for p in await self.jobs.active_placements(cluster=cluster, node=command.node)
            if p.cluster == cluster
        ]
        await self.ctx.bus.publish(drain, Subjects.DRAIN_REQUESTED)
        return {
            "drain_id": drain.event_id,
            "cluster": cluster,
            "node": command.node,
            "ranks": ranks,
        }


async def setup(ctx: ServiceContext) -> None:
    """Register the scheduler's consumer, heartbeat subscription and RPC verbs."""
    scheduler = Scheduler(ctx)
    await ctx.consume("scheduler", scheduler.on_event)
    await ctx.bus.subscribe_core(Subjects.HEARTBEATS_ALL, scheduler.on_heartbeat, queue="scheduler")
    ctx.spawn(scheduler.heartbeat_loop(), "heartbeat-flush")

    async def _final_flush() -> None:
        with contextlib.suppress(Exception):
            await scheduler.flush_heartbeats()

    ctx.closers.append(_final_flush)
    for verb in (
        "job_list",
        "job_get",
        "job_timeline",
        "incident_list",
        "incident_get",
        "drain",
    ):
        await ctx.serve(verb, getattr(scheduler, verb))
    goodput = GoodputVerbs(scheduler.jobs, scheduler.incidents)
    for verb in ("job_goodput", "tenant_goodput"):
        await ctx.serve(verb, getattr(goodput, verb))
    await setup_credentials(ctx)  # job-scoped NATS credentials, auth callout (credentials.py)
    await setup_hosts(ctx)  # the rendezvous of jobs across hosts (hosts.py)
    ctx.readiness["consumer"] = "scheduler"
