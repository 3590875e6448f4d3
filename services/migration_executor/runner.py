"""Carries sagas forward: performs the action of a saga's persisted phase, persists the next.

Handlers only create sagas and record reports; the waits are driven here, by a ticker that
re-reads every unfinished saga from Redis (so a restarted executor resumes them all) and by
kicks when a report for the saga's job arrives. One task per saga at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError

from torchrelay.bus import Bus, BusError, NoResponder, RpcFailed, StaleRevision
from torchrelay.contract import (
    EVENTS_STREAM,
    FenceOrder,
    Generation,
    MigrationCompleted,
    MigrationFailed,
    MigrationMode,
    MigrationStarted,
    Resolution,
    SpareSlot,
    Subjects,
    make_event_id,
    utcnow,
)
from torchrelay.generations import (
    Candidate,
    GenerationError,
    GenerationWriter,
    changed_event,
    replace_rank,
)
from torchrelay.observability import context_from_headers, tracer

from . import saga
from .saga import Lease, Phase, SagaState, Timing
from .store import Created, ExecutorStore, Flags

SOURCE = "migration_executor"
# The durable consumer of the agents' reports (its own, beside the requests' one).
REPORTS_DURABLE = "migration-executor-reports"
# How long a saga whose job finished waits for the reports consumer to catch up before it
# gives the migration up (only while the consumer still holds reports from before the end).
FINISH_GRACE_S = 30.0
# Codes with which the spare pool says "nothing to hand out" rather than "you asked wrong".
_NO_SPARE_CODES = frozenset({"not_found", "conflict", "unavailable"})
_CRASH_EXIT = 86


class SagaRunner:
    """Drives every unfinished saga of this executor."""

    def __init__(
        self,
        bus: Bus,
        store: ExecutorStore,
        timing: Timing,
        *,
        log: logging.Logger,
        rpc_timeout_s: float = 3.0,
        lease_s: float = 300.0,
        crash_at: str | None = None,
        on_done: Callable[[SagaState], None] | None = None,
    ) -> None:
        self.bus = bus
        self.store = store
        self.timing = timing
        self.log = log
        self.rpc_timeout_s = rpc_timeout_s
        self.lease_s = lease_s
        self.crash_at = crash_at
        self.on_done = on_done
        self.on_tick: Callable[[int], None] | None = None
        self.writer = GenerationWriter(bus, SOURCE)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()
        self._finish_seen: dict[str, float] = {}  # migration -> when its job's end was seen
        # The flags read with a saga's last save (in the same round trip), for its next step
        # in the same pass; keyed by migration, with the state they were read after.
        self._saved_flags: dict[str, tuple[SagaState, Flags]] = {}

    # ------------------------------------------------------------------ scheduling

    def kick(
        self, migration_id: str, created: SagaState | None = None, flags: Flags | None = None
    ) -> None:
        """Advance a saga now (or right after the pass already running for it).

        ``created``: the state just stored for a new saga, so its first step need not read
        it back; ``flags``: its step flags, read with it.
        """
        task = self._tasks.get(migration_id)
        if task is not None and not task.done():
            self._again.add(migration_id)
            return
        self._tasks[migration_id] = asyncio.create_task(
            self._drive(migration_id, created, flags), name=f"saga:{migration_id[:12]}"
        )

    def created(self, state: SagaState, outcome: Created) -> None:
        """Start a saga the service just stored (``outcome`` of ``ExecutorStore.create``)."""
        self.kick(state.migration_id, state, outcome.flags)

    async def kick_job(self, job_id: str) -> None:
        """Advance every unfinished saga of a job (a report for it arrived)."""
        active = set(await self.store.active())
        for migration_id in await self.store.of_job(job_id):
            if migration_id in active:
                self.kick(migration_id)

    async def tick_forever(self, poll_s: float) -> None:
        """Re-read every unfinished saga periodically: deadlines and retries live here."""
        while True:
            try:
                active = await self.store.active()
                if self.on_tick is not None:
                    self.on_tick(len(active))
                for migration_id in active:
                    self.kick(migration_id)
            except Exception:
                self.log.exception("saga tick failed; retrying")
            await asyncio.sleep(poll_s)

    async def close(self) -> None:
        tasks = [t for t in self._tasks.values() if not t.done()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def _drive(
        self,
        migration_id: str,
        created: SagaState | None = None,
        flags: Flags | None = None,
    ) -> None:
        try:
            state = created if created is not None else await self.store.load(migration_id)
            parent = context_from_headers(state.trace if state is not None else None)
            with tracer().start_as_current_span(
                "migration_executor saga",
                context=parent,
                attributes={
                    "torchrelay.migration_id": migration_id,
                    "torchrelay.phase": state.phase.value if state else "gone",
                },
            ):
                await self._drive_steps(migration_id, state, flags)
        finally:
            self._saved_flags.pop(migration_id, None)
            if self._tasks.get(migration_id) is asyncio.current_task():
                del self._tasks[migration_id]

    async def _drive_steps(
        self, migration_id: str, loaded: SagaState | None, flags: Flags | None
    ) -> None:
        # This task is the saga's only writer: the state a step persisted is the next step's
        # input (re-reading it from Redis cost a round trip per step on the stall's path).
        # Escalations arrive as a separate flag that every step reads: with the write of
        # the step before (same round trip), or on its own after a fresh load.
        state = loaded
        while True:
            try:
                if state is None:
                    state = await self.store.load(migration_id)
                    flags = None
                if state is None:
                    return
                if state.phase == Phase.DONE:
                    await self.store.finish(state)
                    return
                moved = await self.advance(state, utcnow(), flags)
            except asyncio.CancelledError:
                raise
            except Exception:
                # The state in Redis is unchanged for the failed step; the ticker retries.
                self.log.exception("saga step failed", extra={"migration_id": migration_id})
                return
            saved = self._saved_flags.pop(migration_id, None)
            flags = saved[1] if saved is not None and saved[0] is moved else None
            if moved is None:
                if migration_id in self._again:
                    self._again.discard(migration_id)
                    state = None  # something changed outside this task: read it again
                    continue
                return
            if moved.phase == Phase.DONE:
                await self.store.finish(moved)
                if self.on_done is not None:
                    self.on_done(moved)
                return
            state = moved

    async def _save(self, state: SagaState) -> SagaState:
        self._saved_flags[state.migration_id] = (state, await self.store.save(state))
        return state

    async def _crash_point(self, point: str, state: SagaState) -> None:
        """Test hook (TORCHRELAY_TEST_CRASH_AT): die like kill -9 at a named point.

        Once per saga and point, so a supervisor that restarts the executor with the same
        environment sees it finish the saga instead of crashing in a loop.
        """
        if self.crash_at == point and await self.store.once(f"crash:{point}:{state.migration_id}"):
            self.log.warning("crashing at %s on purpose (TORCHRELAY_TEST_CRASH_AT)", point)
            os._exit(_CRASH_EXIT)

    # ------------------------------------------------------------------ one step

    async def advance(
        self, state: SagaState, now: datetime, flags: Flags | None = None
    ) -> SagaState | None:
        """Perform the action of ``state``'s phase; the persisted next state, or None.

        ``flags``: the saga's step flags if they were just read (else they are read here).
        """
        if state.to_release or state.to_quarantine or state.to_fence:
            return await self._compensate(state)
        if flags is None:
            flags = await self.store.step_flags(state.migration_id, state.job_id)
        escalation, job_finished = flags
        if escalation:
            escalated = saga.escalate(state, now)
            if escalated is not state:
                await self._save(escalated)
            await self.store.escalation_done(state.migration_id)
            self._saved_flags.pop(state.migration_id, None)  # read before the flag went
            if escalated is not state:
                return escalated
        if state.phase in saga.ABORTABLE and job_finished:
            if state.phase == Phase.AWAIT_RESUME:
                # The job may have finished *on* the new generation: the ranks' RESUMED
                # reports, published before the job's end, can still wait on the reports
                # consumer while JobFinished (on the requests' consumer) was handled first.
                moved = await self._await_resume(state, now)
                if moved is not None:
                    self._finish_seen.pop(state.migration_id, None)
                    return moved
                if not await self._reports_caught_up(state):
                    return None
            self._finish_seen.pop(state.migration_id, None)
            return await self._save(saga.aborted(state, now, "the job finished"))
        if saga.waiting_for(state, now):
            return None
        handler = {
            Phase.RESERVE: self._reserve,
            Phase.WAIT_SPARE: self._reserve,
            Phase.SPAWN: self._spawn,
            Phase.AWAIT_JOIN: self._await_join,
            Phase.PUBLISH: self._publish,
            Phase.AWAIT_RESUME: self._await_resume,
            Phase.CONFIRM: self._confirm,
            Phase.SHRINK: self._shrink,
            Phase.QUARANTINE: self._quarantine,
            Phase.FENCE: self._fence,
            Phase.ESCALATE: self._republish_immediate,
            Phase.COMPLETE: self._complete,
            Phase.FAIL: self._fail,
        }[state.phase]
        return await handler(state, now)

    async def _reports_caught_up(self, state: SagaState) -> bool:
        """Whether every report published before the job's JobFinished has been handled
        (or ``FINISH_GRACE_S`` passed since this saga first saw the job finished)."""
        first = self._finish_seen.setdefault(state.migration_id, time.monotonic())
        if time.monotonic() - first > FINISH_GRACE_S:
            return True
        seq = await self.store.finished_seq(state.job_id)
        if seq <= 0:
            return True  # recorded before the sequence was kept
        try:
            info = await self.bus.js.consumer_info(EVENTS_STREAM.name, REPORTS_DURABLE)
        except Exception as exc:
            self.log.warning("cannot read the reports consumer's position: %r", exc)
            return True  # cannot tell: do not hold the saga on it
        floor = getattr(info.ack_floor, "stream_seq", 0) or 0
        if floor >= seq:
            return True
        return not info.num_pending and not info.num_ack_pending

    async def _request(self, subject: str, payload: dict[str, Any]) -> Any:
        return await self.bus.request(subject, payload, timeout=self.rpc_timeout_s)

    async def _reserve(self, state: SagaState, now: datetime) -> SagaState | None:
        if state.mode == MigrationMode.BOUNDARY and await self._job_settling(state):
            # A generation of this job is still being entered; a boundary migration waits
            # until every rank resumed in it (agents agree on the switch inside a step).
            return None
        locked = await self.store.lock_job(state.job_id, state.migration_id)
        if not locked and not await self._preempt_boundary(state):
            # Another migration of this job is changing its generation: wait our turn.
            return None
        payload = {
            "job_id": state.job_id,
            "cluster": state.terms.cluster,
            "near_node": state.failed_node,
            "lease_s": self.lease_s,
            # A reservation retried after a crash gets the same lease back.
            "request_id": make_event_id("reserve", state.migration_id, state.attempt),
        }
        try:
            result = await self._request(Subjects.rpc("spare_pool", "reserve"), payload)
        except NoResponder as exc:
            self.log.warning("spare pool unreachable: %s", exc)
            return await self._save(saga.pool_unreachable(state, now, self.timing))
        except RpcFailed as exc:
            if exc.error.code not in _NO_SPARE_CODES:
                self.log.warning("spare pool refused the reservation: %s", exc)
            return await self._save(saga.no_spare(state, now, self.timing, exc.error.message))
        except BusError as exc:  # a malformed reply: as good as no answer
            self.log.warning("spare pool answered badly: %s", exc)
            return await self._save(saga.pool_unreachable(state, now, self.timing))
        lease = _lease(result)
        if lease is None:
            return await self._save(saga.no_spare(state, now, self.timing, "no lease"))
        moved = await self._save(saga.reserved(state, lease, now, self.timing))
        self.log.info(
            "spare reserved",
            extra={
                "migration_id": state.migration_id,
                "lease_id": lease.lease_id,
                "slot_id": lease.slot.slot_id,
                "member_id": lease.slot.member_id,
            },
        )
        await self._crash_point("after_reserve", state)
        return moved

    async def _spawn(self, state: SagaState, now: datetime) -> SagaState | None:
        assert state.lease is not None
        slot = state.lease.slot
        try:
            result = await self._request(
                Subjects.launcher(state.job_id, "spawn_spare"),
                {"node": slot.node, "gpu": slot.gpu, "slot_id": slot.slot_id},
            )
            member_id = str(result["member_id"])
        except (BusError, KeyError, TypeError) as exc:
            return await self._save(
                saga.timed_out(state, now, self.timing, f"could not start a spare: {exc}")
            )
        return await self._save(saga.spawned(state, member_id, now, self.timing))

    async def _await_join(self, state: SagaState, now: datetime) -> SagaState | None:
        assert state.spare_member is not None
        if await self.store.has_joined(state.job_id, state.spare_member):
            return await self._save(saga.joined(state, now))
        if state.deadline is not None and now >= state.deadline:
            return await self._save(
                saga.timed_out(state, now, self.timing, f"{state.spare_member} did not join")
            )
        return None

    async def _current(self, state: SagaState) -> tuple[Generation, int] | None:
        return await self.writer.current(state.job_id)

    async def _publish(self, state: SagaState, now: datetime) -> SagaState | None:
        assert state.lease is not None
        assert state.spare_member is not None
        found = await self._current(state)
        if found is None:
            return await self._save(
                saga.fail(state, Resolution.LOST, now, "the job has no generation")
            )
        current, revision = found
        if _written_by(current, state, state.spare_member):
            # Written before a crash: announce it again (same event id) and go on.
            await self.bus.publish(changed_event(current, SOURCE), Subjects.GENERATION_CHANGED)
            return await self._after_publish(state, current, now)
        holder = next((a.member_id for a in current.ranks if a.rank == state.rank), None)
        if holder != state.holder_member:
            return await self._save(
                saga.fail(
                    state,
                    Resolution.LOST,
                    now,
                    f"rank {state.rank} is held by {holder}, not {state.holder_member}",
                )
            )
        # Only the new store host's address is needed: the lowest rank that stays, or the
        # spare in a world of one (reading every member's report would not scale).
        stays = [a for a in sorted(current.ranks, key=lambda a: a.rank) if a.rank != state.rank]
        wanted = [stays[0].member_id] if stays else []
        addrs = await self.store.store_addrs(state.job_id, [*wanted, state.spare_member])
        slot = state.lease.slot
        candidate = Candidate(
            state.spare_member, slot.node, slot.gpu, addrs.get(state.spare_member)
        )
        try:
            nxt = replace_rank(
                current,
                state.rank,
                candidate,
                mode=state.mode,
                store_addrs=addrs,
                migration_id=state.migration_id,
                reason=state.fault_kind.value,
            )
        except GenerationError as exc:
            # The spare cannot take the rank (it already holds one): hand it back, try another.
            return await self._save(saga.timed_out(state, now, self.timing, str(exc)))
        try:
            await self.bus.put_generation(nxt, revision)
        except StaleRevision:
            self.log.info(
                "generation changed under us; re-planning",
                extra={"migration_id": state.migration_id},
            )
            self._again.add(state.migration_id)
            return None
        await self._crash_point("after_publish", state)
        await self.bus.publish(changed_event(nxt, SOURCE), Subjects.GENERATION_CHANGED)
        return await self._after_publish(state, nxt, now)

    async def _after_publish(self, state: SagaState, gen: Generation, now: datetime) -> SagaState:
        assert state.lease is not None
        await self.bus.publish(
            MigrationStarted(
                event_id=make_event_id("migration_started", state.migration_id, gen.generation),
                source=SOURCE,
                migration_id=state.migration_id,
                incident_id=state.incident_id,
                job_id=state.job_id,
                rank=state.rank,
                lease_id=state.lease.lease_id,
                spare_slot_id=state.lease.slot.slot_id,
                generation_before=gen.generation - 1,
                generation_after=gen.generation,
            ),
            Subjects.MIGRATION_STARTED,
        )
        moved = await self._save(saga.published(state, gen, now, self.timing))
        if state.mode == MigrationMode.IMMEDIATE:
            # The generation is written: another migration of the job (a second failure
            # while this one waits for its ranks) may now write the next one on top of it.
            await self.store.unlock_job(state.job_id, state.migration_id)
        # A boundary migration keeps the lock until its ranks resumed: two boundary
        # generations in quick succession race the agents' group formation. A fatal fault
        # does not wait for it (see _preempt_boundary).
        return moved

    async def _job_settling(self, state: SagaState) -> bool:
        """Whether another saga of the job published a generation its ranks have not resumed."""
        active = set(await self.store.active())
        for other_id in await self.store.of_job(state.job_id):
            if other_id == state.migration_id or other_id not in active:
                continue
            other = await self.store.load(other_id)
            if other is not None and other.phase == Phase.AWAIT_RESUME:
                return True
        return False

    async def _preempt_boundary(self, state: SagaState) -> bool:
        """An immediate migration takes the lock from a boundary one already published."""
        if state.mode != MigrationMode.IMMEDIATE:
            return False
        holder = await self.store.job_lock_holder(state.job_id)
        if holder is None:
            return await self.store.lock_job(state.job_id, state.migration_id)
        other = await self.store.load(holder)
        if other is None or other.phase == Phase.DONE:
            return await self.store.take_job_lock(state.job_id, state.migration_id, holder)
        if other.mode == MigrationMode.BOUNDARY and other.generation_after is not None:
            return await self.store.take_job_lock(state.job_id, state.migration_id, holder)
        return False

    async def _await_resume(self, state: SagaState, now: datetime) -> SagaState | None:
        assert state.generation_after is not None
        # The generations to look at: ours, and a newer one written by a later migration
        # (a second failure) while we waited, as long as it keeps our spare in our rank.
        views = [(state.generation_after, state.members_after)]
        found = await self._current(state)
        if found is not None and found[0].generation > state.generation_after:
            newest = found[0]
            if state.spare_member and newest.member_rank(state.spare_member) != state.rank:
                # Our spare failed too and a later migration replaced it: the rank lives on
                # in that generation, so this migration completes there (our lease goes back).
                holder = next((a for a in newest.ranks if a.rank == state.rank), None)
                if holder is None:
                    return await self._save(
                        saga.fail(
                            state,
                            Resolution.LOST,
                            now,
                            f"rank {state.rank} left the job in generation {newest.generation}",
                        )
                    )
                return await self._save(saga.superseded(state, newest, holder, now, self.timing))
            views.append((newest.generation, [a.member_id for a in newest.ranks]))
        for generation, _ in views:
            lost = await self.store.state_lost(state.job_id, generation)
            if lost is not None:
                return await self._save(
                    saga.fail(
                        state,
                        Resolution.CHECKPOINT_RESTART,
                        now,
                        f"the rank's state cannot be restored live: {lost}",
                    )
                )
        expired = state.deadline is not None and now >= state.deadline
        missing: list[str] = []
        for generation, members in reversed(views):
            # Before the deadline only a complete set of reports can finish the migration:
            # while the ranks are still resuming the store answers with their number alone.
            reports = await self.store.resumed(
                state.job_id, generation, at_least=0 if expired else len(members)
            )
            if reports is None:
                continue
            stats = saga.resume_stats(members, state.spare_member, reports)
            if stats is None and expired:
                # Past the deadline, a spare that resumed completes the migration even if a
                # survivor did not: that survivor's own failure is another incident's job.
                stats = saga.resume_stats(members, state.spare_member, reports, partial=True)
            if stats is not None:
                return await self._save(saga.resumed(state, stats, now))
            missing = [m for m in members if m not in reports]
        if expired:
            return await self._save(
                saga.timed_out(state, now, self.timing, f"no RESUMED from {', '.join(missing)}")
            )
        return None

    async def _republish_immediate(self, state: SagaState, now: datetime) -> SagaState | None:
        assert state.generation_after is not None
        found = await self._current(state)
        if found is None:
            return await self._save(
                saga.fail(state, Resolution.LOST, now, "the job has no generation")
            )
        current, revision = found
        if current.generation > state.generation_after:
            if current.migration_id == state.migration_id:  # ours, written before a crash
                await self.bus.publish(changed_event(current, SOURCE), Subjects.GENERATION_CHANGED)
                return await self._save(saga.republished(state, current, now, self.timing))
            # A later migration wrote a newer generation already (immediate by then, or
            # followed by its own): wait on, as _await_resume follows newer generations.
            return await self._save(
                state.model_copy(update={"phase": Phase.AWAIT_RESUME, "updated_at": now})
            )
        again = current.model_copy(
            update={
                "generation": current.generation + 1,
                "mode": state.mode,
                "reason": f"escalated: {current.reason}",
                "written_at": utcnow(),
            }
        )
        try:
            await self.bus.put_generation(again, revision)
        except StaleRevision:
            self._again.add(state.migration_id)
            return None
        await self.bus.publish(changed_event(again, SOURCE), Subjects.GENERATION_CHANGED)
        return await self._save(saga.republished(state, again, now, self.timing))

    async def _best_effort(
        self, state: SagaState, now: datetime, subject: str, payload: dict[str, Any], what: str
    ) -> bool:
        """A side request that must not block the saga forever: True when it is done."""
        try:
            await self._request(subject, payload)
            return True
        except NoResponder as exc:
            if (now - state.phase_since).total_seconds() >= self.timing.reserve_timeout_s:
                self.log.warning("%s unanswered, going on: %s", what, exc)
                return True
            await self._save(
                state.model_copy(
                    update={"next_try_at": now + timedelta(seconds=self.timing.retry_s)}
                )
            )
            return False
        except BusError as exc:  # refused, or a malformed reply: nothing to retry
            self.log.warning("%s refused: %s", what, exc)
            return True

    async def _confirm(self, state: SagaState, now: datetime) -> SagaState | None:
        if state.lease is None:  # superseded: the spare in use is another migration's lease
            return await self._save(saga.confirmed(state, now))
        if not await self._best_effort(
            state,
            now,
            Subjects.rpc("spare_pool", "confirm"),
            {"lease_id": state.lease.lease_id},
            "lease confirm",
        ):
            return None
        return await self._save(saga.confirmed(state, now))

    async def _quarantine(self, state: SagaState, now: datetime) -> SagaState | None:
        if saga.should_quarantine(state.fault_kind) and not await self._best_effort(
            state,
            now,
            Subjects.rpc("spare_pool", "quarantine"),
            {
                "node": state.failed_node,
                "gpu": state.failed_gpu,
                "cluster": state.terms.cluster,
                "reason": f"{state.fault_kind.value} (incident {state.incident_id})",
            },
            "quarantine",
        ):
            return None
        return await self._save(saga.quarantined(state, now))

    async def _fence_member(self, state: SagaState, member_id: str) -> None:
        order = FenceOrder(
            job_id=state.job_id,
            member_id=member_id,
            generation=state.generation_after or state.generation_before,
            reason=f"replaced by migration {state.migration_id}",
        )
        try:
            await self.bus.request(Subjects.fence(state.job_id), order, timeout=self.rpc_timeout_s)
        except BusError as exc:
            # The member fences itself when it sees the newer generation (docs/design.md §3,
            # step 4).
            self.log.warning("fence of %s not confirmed: %s", member_id, exc)

    async def _fence(self, state: SagaState, now: datetime) -> SagaState | None:
        for member in saga.members_to_fence(state):
            await self._fence_member(state, member)
        return await self._save(saga.fenced(state, now))

    async def _complete(self, state: SagaState, now: datetime) -> SagaState | None:
        assert state.stats is not None
        assert state.generation_after is not None
        await self.bus.publish(
            MigrationCompleted(
                event_id=make_event_id("migration_completed", state.migration_id),
                source=SOURCE,
                migration_id=state.migration_id,
                incident_id=state.incident_id,
                job_id=state.job_id,
                rank=state.rank,
                mode=state.mode,
                to_node=saga.destination(state)[0],
                to_gpu=saga.destination(state)[1],
                generation_before=state.generation_before,
                generation_after=state.generation_after,
                stall_ms=state.stats.stall_ms,
                lost_steps=state.stats.lost_steps,
                bytes_moved=state.stats.bytes_moved,
            ),
            Subjects.MIGRATION_COMPLETED,
        )
        return await self._save(saga.done(state, now))

    async def _fail(self, state: SagaState, now: datetime) -> SagaState | None:
        assert state.fallback is not None
        await self.bus.publish(
            MigrationFailed(
                event_id=make_event_id("migration_failed", state.migration_id),
                source=SOURCE,
                migration_id=state.migration_id,
                incident_id=state.incident_id,
                job_id=state.job_id,
                reason=state.reason or "migration failed",
                fallback=state.fallback,
                node=state.failed_node,
                gpu=state.failed_gpu,
                fault_kind=state.fault_kind,
            ),
            Subjects.MIGRATION_FAILED,
        )
        return await self._save(saga.done(state, now))

    async def _shrink(self, state: SagaState, now: datetime) -> SagaState | None:
        found = await self._current(state)
        if found is None:
            return await self._save(
                saga.fail(state, Resolution.LOST, now, "the job has no generation")
            )
        current, revision = found
        if _written_by(current, state, None):
            await self.bus.publish(changed_event(current, SOURCE), Subjects.GENERATION_CHANGED)
            return await self._save(saga.shrunk(state, current, now))
        stays = [a for a in sorted(current.ranks, key=lambda a: a.rank) if a.rank != state.rank]
        addrs = await self.store.store_addrs(state.job_id, [a.member_id for a in stays[:1]])
        try:
            nxt = saga.shrink_generation(
                current,
                state.rank,
                addrs,
                state.migration_id,
                reason=f"shrink: {state.fault_kind.value}",
            )
        except ValueError as exc:
            return await self._save(
                saga.fail(state, Resolution.CHECKPOINT_RESTART, now, f"cannot shrink: {exc}")
            )
        try:
            await self.bus.put_generation(nxt, revision)
        except StaleRevision:
            self._again.add(state.migration_id)
            return None
        await self.bus.publish(changed_event(nxt, SOURCE), Subjects.GENERATION_CHANGED)
        return await self._save(saga.shrunk(state, nxt, now))

    async def _compensate(self, state: SagaState) -> SagaState | None:
        """Carry out one pending compensation; each is removed once done."""
        if state.to_release:
            lease_id = state.to_release[0]
            try:
                await self._request(
                    Subjects.rpc("spare_pool", "release"),
                    {
                        "lease_id": lease_id,
                        "reason": state.reason or f"migration {state.migration_id} compensated",
                    },
                )
            except NoResponder:
                # An unconfirmed lease expires by itself: try again until it would have.
                if (utcnow() - state.updated_at).total_seconds() < self.lease_s:
                    return None
                self.log.warning("lease %s never released: the pool was unreachable", lease_id)
            except BusError as exc:
                self.log.warning("release of lease %s refused: %s", lease_id, exc)
            return await self._save(saga.compensated(state, released=lease_id))
        if state.to_quarantine:
            ref = state.to_quarantine[0]
            try:
                await self._request(
                    Subjects.rpc("spare_pool", "quarantine"),
                    {
                        "node": ref.node,
                        "gpu": ref.gpu,
                        "cluster": ref.cluster,
                        "reason": ref.reason,
                    },
                )
            except BusError as exc:
                self.log.warning("quarantine of %s:%s failed: %s", ref.node, ref.gpu, exc)
            return await self._save(saga.compensated(state, quarantined_slot=ref))
        member = state.to_fence[0]
        await self._fence_member(state, member)
        return await self._save(saga.compensated(state, fenced_member=member))


def _written_by(current: Generation, state: SagaState, newcomer: str | None) -> bool:
    """True if ``current`` is the generation this attempt of the saga writes.

    An earlier attempt of the same migration also wrote a generation with its id, so the
    id alone is not enough: the holder must have departed and the newcomer (or, for a
    shrink, nobody) hold the rank.
    """
    if current.migration_id != state.migration_id or state.holder_member not in current.departing:
        return False
    if newcomer is None:
        return current.member_rank(state.holder_member) is None
    return current.member_rank(newcomer) == state.rank


def _lease(result: Any) -> Lease | None:
    if not isinstance(result, dict) or not result.get("lease_id"):
        return None
    try:
        return Lease(
            lease_id=str(result["lease_id"]),
            slot=SpareSlot.model_validate(result["slot"]),
            expires_at=result.get("expires_at"),
        )
    except (KeyError, ValidationError):
        return None
