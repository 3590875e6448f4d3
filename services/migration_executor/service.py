"""The migration executor service: forms generation 1 and runs every migration as a saga.

Consumes ``migration-executor`` (MigrationRequested, JobRegistered, JobFinished) and, on a
consumer of their own so that a migration request never waits behind them,
``migration-executor-reports`` (the agents' reports). Handlers only persist and kick;
``runner.SagaRunner`` performs the steps.
Answers ``tr.rpc.migration_executor.saga_list`` and ``saga_get``.
"""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field

from torchrelay.bus import Delivery, NotFound, PermanentError, StaleRevision
from torchrelay.contract import (
    AgentReport,
    Event,
    JobFinished,
    JobRegistered,
    JobRestarted,
    MigrationMode,
    MigrationRequested,
    ReportKind,
    Role,
    Subjects,
    Token,
    utcnow,
)
from torchrelay.generations import (
    GenerationError,
    changed_event,
    form_first,
    restart_generation,
)
from torchrelay.observability import inject_headers
from torchrelay.service import ServiceContext
from torchrelay.settings import ServiceSettings, load_settings

from . import saga
from .runner import REPORTS_DURABLE, SOURCE, SagaRunner
from .saga import JobTerms, SagaState, Timing
from .store import ExecutorStore


class ExecutorSettings(ServiceSettings):
    """Deadlines and retries of the saga (environment ``TORCHRELAY_<NAME>``)."""

    join_timeout_s: float = Field(default=60.0, gt=0)
    resume_timeout_s: float = Field(default=30.0, gt=0)
    reserve_timeout_s: float = Field(default=10.0, gt=0)
    retry_s: float = Field(default=1.0, gt=0)
    poll_s: float = Field(default=0.1, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    lease_s: float = Field(default=300.0, gt=0)
    rpc_timeout_s: float = Field(default=3.0, gt=0)
    # Test hook: the executor exits like kill -9 at this point (e.g. "after_reserve").
    test_crash_at: str | None = None

    def timing(self) -> Timing:
        return Timing(
            join_timeout_s=self.join_timeout_s,
            resume_timeout_s=self.resume_timeout_s,
            reserve_timeout_s=self.reserve_timeout_s,
            retry_s=self.retry_s,
            max_attempts=self.max_attempts,
        )


class _SagaListQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job_id: Token | None = None
    active: bool | None = None
    limit: int = Field(default=100, ge=1, le=1000)
    cursor: str | None = Field(default=None, pattern=r"^[0-9]+$")


class _SagaQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")
    migration_id: str = Field(min_length=1, max_length=128)


def executor_settings(settings: ServiceSettings) -> ExecutorSettings:
    """The executor's settings: as given, or the common ones plus the environment's."""
    if isinstance(settings, ExecutorSettings):
        return settings
    base = settings.model_dump(exclude_unset=True)
    return load_settings(ExecutorSettings, **base)


class Executor:
    """The executor's handlers over its Redis state."""

    def __init__(self, ctx: ServiceContext, settings: ExecutorSettings) -> None:
        self.ctx = ctx
        self.settings = settings
        self.store = ExecutorStore(ctx.redis, ctx.prefix)
        self.migrations = Counter(
            "torchrelay_migrations_total",
            "Migrations finished, by outcome and fallback",
            ["outcome", "fallback"],
            registry=ctx.metrics.registry,
        )
        self.durations = Histogram(
            "torchrelay_migration_seconds",
            "Time from request to outcome",
            registry=ctx.metrics.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.runner = SagaRunner(
            ctx.bus,
            self.store,
            settings.timing(),
            log=ctx.log,
            rpc_timeout_s=settings.rpc_timeout_s,
            lease_s=settings.lease_s,
            crash_at=settings.test_crash_at,
            on_done=self._observe,
        )
        active = Gauge(
            "torchrelay_sagas_active", "Migrations under way", registry=ctx.metrics.registry
        )
        self.runner.on_tick = active.set

    def _observe(self, state: SagaState) -> None:
        self.migrations.labels(
            state.outcome or "unknown", state.fallback.value if state.fallback else ""
        ).inc()
        self.durations.observe((state.updated_at - state.created_at).total_seconds())

    async def on_event(self, event: Event, delivery: Delivery) -> None:
        """Dispatch one event of the ``migration-executor`` consumer."""
        if isinstance(event, MigrationRequested):
            await self.on_migration_requested(event)
        elif isinstance(event, AgentReport):
            await self.on_report(event)  # left on this durable from before reports had their own
        elif isinstance(event, JobRegistered):
            await self.store.put_job(event)
            await self.try_form(event.job_id)
        elif isinstance(event, JobRestarted):
            await self.store.put_restart(event)
            await self.try_form(event.job_id)
        elif isinstance(event, JobFinished):
            await self.store.mark_finished(event.job_id, event.outcome, delivery.stream_seq)
            await self.runner.kick_job(event.job_id)
            await self.store.forget_reports(event.job_id)
        else:
            raise PermanentError(f"migration executor does not handle {type(event).__name__}")

    async def on_migration_requested(self, request: MigrationRequested) -> None:
        """Start the migration's saga once; a repeated request finds it and does nothing."""
        job = await self.store.job(request.job_id)
        # The world size now, not at registration: a shrink or a restart on fewer slots
        # may have made it smaller (a job of one rank cannot shrink).
        current = await self.ctx.bus.get_generation(request.job_id)
        terms = (
            JobTerms()
            if job is None
            else JobTerms(
                cluster=job.cluster,
                world_size=job.world_size if current is None else current[0].world_size,
                policy=job.policy,
                wait_timeout_s=job.wait_timeout_s,
                allow_shrink=job.allow_shrink,
            )
        )
        state = saga.start(request, terms, utcnow()).model_copy(update={"trace": inject_headers()})
        outcome = await self.store.create(state, request)
        if outcome.created:
            self.runner.created(state, outcome)
        elif request.mode == MigrationMode.IMMEDIATE:
            # The scheduler escalated a boundary migration (a fatal fault on the leaving
            # rank); the runner applies it, as the saga's only writer.
            await self.store.request_escalation(request.migration_id)
            self.runner.kick(request.migration_id)
        else:
            self.ctx.log.info(
                "migration already has a saga", extra={"migration_id": request.migration_id}
            )

    async def on_report_event(self, event: Event, delivery: Delivery) -> None:
        """Dispatch one event of the ``migration-executor-reports`` consumer."""
        del delivery
        if not isinstance(event, AgentReport):
            raise PermanentError(
                f"migration executor's report consumer does not handle {type(event).__name__}"
            )
        await self.on_report(event)

    async def on_report(self, report: AgentReport) -> None:
        if report.kind == ReportKind.STATE_LOST:
            # The migrations into that generation cannot end live: their sagas fail over
            # to the restart from the checkpoint (runner._await_resume).
            why = report.error or f"generation {report.generation} lost a rank's state"
            await self.store.put_state_lost(report.job_id, report.generation, why)
            await self.runner.kick_job(report.job_id)
            return
        if report.kind not in (ReportKind.JOINED, ReportKind.RESUMED):
            return
        if report.kind == ReportKind.JOINED:
            await self.store.add_joined(report)
            await self.try_form(report.job_id)
            finished = await self.store.finished(report.job_id)
        else:
            so_far = await self.store.add_resumed(report)
            if report.generation == 1:
                await self.store.mark_running(report.job_id)
            finished = so_far.job_finished
            if not finished and so_far.awaited is not None and so_far.reported < so_far.awaited:
                # A saga waits for this generation and more of its members are to report:
                # only the last one can complete it (the ticker still watches its deadline).
                return
        if finished:
            # JobFinished arrives on the other consumer and may have been handled first: let
            # what this report wrote expire like the rest of the job's reports (a saga that
            # waits for it still reads it, below).
            await self.store.forget_reports(report.job_id)
        await self.runner.kick_job(report.job_id)

    async def try_form(self, job_id: str) -> None:
        """Write generation 1 once every worker of a registered job joined (docs/design.md §7)."""
        job = await self.store.job(job_id)
        if job is None or await self.store.finished(job_id):
            return
        restart = await self.store.restart(job_id)
        formed = await self.ctx.redis.get(f"{self.ctx.prefix}:formed_restart:{job_id}")
        if restart is not None and int(formed or 0) < restart.restart:
            await self._form_restart(restart)
            return
        if await self.ctx.redis.exists(f"{self.ctx.prefix}:formed:{job_id}"):
            return
        bus = self.ctx.bus
        existing = await bus.get_generation(job_id)
        if existing is None:
            if await self.store.workers_joined(job_id) < job.world_size:
                return  # not yet: reading every report on every JOINED would be quadratic
            joined = await self.store.joined(job_id)
            try:
                first = form_first(job_id, job.world_size, joined.values())
            except GenerationError as exc:
                self.ctx.log.warning("cannot form job %s: %s", job_id, exc)
                return
            if first is None:
                return
            # StaleRevision: formed by an earlier delivery of ours; announce what is there.
            with contextlib.suppress(StaleRevision):
                await bus.put_generation(first, None)
            existing = await bus.get_generation(job_id)
            if existing is None:
                return
        gen, _ = existing
        if gen.generation == 1:
            await bus.publish(changed_event(gen, SOURCE), Subjects.GENERATION_CHANGED)
        await self.ctx.redis.set(f"{self.ctx.prefix}:formed:{job_id}", gen.generation)
        self.ctx.log.info("job formed", extra={"job_id": job_id, "world_size": gen.world_size})

    async def _form_restart(self, restart: JobRestarted) -> None:
        """The generation after the job's current one, naming the restart's new members,
        once every one of them has joined (docs/design.md §13)."""
        job_id, bus = restart.job_id, self.ctx.bus
        joined = await self.store.joined(job_id)
        wanted = [m for m in restart.members if m.role == Role.WORKER]
        if any(m.member_id not in joined for m in wanted):
            return  # not yet: the last member's JOINED forms it
        existing = await bus.get_generation(job_id)
        try:
            gen = restart_generation(
                existing[0] if existing else None,
                restart.world_size,
                [joined[m.member_id] for m in wanted],
            )
        except GenerationError as exc:
            self.ctx.log.warning("cannot form the restart of job %s: %s", job_id, exc)
            return
        try:
            await bus.put_generation(gen, existing[1] if existing else None)
        except StaleRevision:  # written meanwhile: by an earlier delivery of ours, or not
            now = await bus.get_generation(job_id)
            if now is None or any(now[0].member_rank(m.member_id) is None for m in wanted):
                self.ctx.log.warning("job %s changed while its restart formed", job_id)
                return
            gen = now[0]
        await bus.publish(changed_event(gen, SOURCE), Subjects.GENERATION_CHANGED)
        await self.ctx.redis.set(f"{self.ctx.prefix}:formed_restart:{job_id}", restart.restart)
        self.ctx.log.info(
            "job restarted",
            extra={"job_id": job_id, "generation": gen.generation, "restart": restart.restart},
        )

    # ------------------------------------------------------------------ rpc

    async def saga_list(self, body: dict[str, Any]) -> dict[str, Any]:
        query = _SagaListQuery.model_validate(body)
        ids = await self.store.of_job(query.job_id) if query.job_id else await self.store.all_ids()
        active = set(await self.store.active())
        items = []
        for migration_id in ids:
            if query.active is not None and (migration_id in active) != query.active:
                continue
            state = await self.store.load(migration_id)
            if state is not None:
                items.append(_summary(state))
        items.sort(key=lambda s: str(s["created_at"]), reverse=True)
        start = int(query.cursor or 0)
        end = start + query.limit
        return {"items": items[start:end], "next_cursor": str(end) if end < len(items) else None}

    async def saga_get(self, body: dict[str, Any]) -> dict[str, Any]:
        query = _SagaQuery.model_validate(body)
        state = await self.store.load(query.migration_id)
        if state is None:
            raise NotFound(f"migration {query.migration_id} has no saga", "migration_id")
        return state.model_dump(mode="json")


def _acted_on(event: Event) -> bool:
    """The reports the executor acts on; the others (most of them) are acked unread."""
    return not isinstance(event, AgentReport) or event.kind in (
        ReportKind.JOINED,
        ReportKind.RESUMED,
        ReportKind.STATE_LOST,
    )


def _summary(state: SagaState) -> dict[str, Any]:
    return {
        "migration_id": state.migration_id,
        "incident_id": state.incident_id,
        "job_id": state.job_id,
        "rank": state.rank,
        "phase": state.phase.value,
        "mode": state.mode.value,
        "attempt": state.attempt,
        "outcome": state.outcome,
        "fallback": state.fallback.value if state.fallback else None,
        "spare_member": state.spare_member,
        "generation_before": state.generation_before,
        "generation_after": state.generation_after,
        "created_at": state.created_at.isoformat(),
        "updated_at": state.updated_at.isoformat(),
    }


async def setup(ctx: ServiceContext) -> None:
    """Register the executor's consumer and verbs, and resume every unfinished saga."""
    settings = executor_settings(ctx.settings)
    executor = Executor(ctx, settings)
    await ctx.consume("migration-executor", executor.on_event)
    await ctx.consume(REPORTS_DURABLE, executor.on_report_event, wants=_acted_on)
    await ctx.serve("saga_list", executor.saga_list)
    await ctx.serve("saga_get", executor.saga_get)
    # The ticker's first pass resumes every saga a previous process left unfinished.
    ctx.spawn(executor.runner.tick_forever(settings.poll_s), "saga-ticker")
    ctx.closers.append(executor.runner.close)
    ctx.readiness["consumer"] = "migration-executor, migration-executor-reports"
