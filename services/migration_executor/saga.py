"""The migration saga as a pure state machine (docs/design.md §7).

reserve → (spawn a cold spare → await its JOINED) → publish generation g+1 → await RESUMED
from every rank of g+1 → confirm the lease → quarantine the old slot → fence the old member
→ complete. Each wait has a deadline; past it the saga compensates (release the lease, try
the next spare) and, when spares run out, applies the job's policy (wait, shrink,
checkpoint_restart).

The state is a pydantic model that ``runner.py`` persists in Redis *before* it performs the
action the phase names, so a crash or a redelivered request resumes the saga where it was.
Every function here is pure: it takes a state (and what an action returned) and gives the
next state.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from torchrelay.contract import (
    FaultKind,
    Generation,
    JobPolicy,
    MigrationMode,
    MigrationRequested,
    RankAssignment,
    Resolution,
    SpareSlot,
)


class Phase(StrEnum):
    """Where a saga is; the runner performs the phase's action, then moves it on."""

    RESERVE = "reserve"  # ask the spare pool for a spare
    WAIT_SPARE = "wait_spare"  # policy wait: none to be had, ask again until wait_until
    SPAWN = "spawn"  # cold slot: ask the job's launcher to start a spare there
    AWAIT_JOIN = "await_join"  # wait for the spawned spare's JOINED report
    PUBLISH = "publish"  # write generation g+1 (KV compare-and-set)
    AWAIT_RESUME = "await_resume"  # wait for RESUMED from every rank of g+1
    CONFIRM = "confirm"  # confirm the lease: the spare is in use
    SHRINK = "shrink"  # policy shrink: write a generation without the rank
    QUARANTINE = "quarantine"  # take the failed slot out of service
    FENCE = "fence"  # tell the launcher to kill the old member if it still lives
    ESCALATE = "escalate"  # rewrite a published boundary generation as immediate
    COMPLETE = "complete"  # publish MigrationCompleted
    FAIL = "fail"  # publish MigrationFailed with the fallback taken
    DONE = "done"


TERMINAL = frozenset({Phase.DONE})
# Phases during which a job's end makes the saga moot (nothing of g+1 is committed yet).
ABORTABLE = frozenset(
    {
        Phase.RESERVE,
        Phase.WAIT_SPARE,
        Phase.SPAWN,
        Phase.AWAIT_JOIN,
        Phase.PUBLISH,
        Phase.AWAIT_RESUME,
        Phase.ESCALATE,
        Phase.SHRINK,
    }
)


class Lease(BaseModel):
    """A spare-pool reservation held by the saga."""

    model_config = ConfigDict(frozen=True)
    lease_id: str
    slot: SpareSlot
    expires_at: datetime | None = None


class SlotRef(BaseModel):
    """A slot to take out of service (a compensation step)."""

    model_config = ConfigDict(frozen=True)
    node: str
    gpu: int
    cluster: str = "local"
    reason: str


class ResumeStats(BaseModel):
    """What the agents reported when they resumed in the new generation."""

    model_config = ConfigDict(frozen=True)
    stall_ms: float = 0.0
    lost_steps: int = 0
    bytes_moved: int = 0


class JobTerms(BaseModel):
    """The parts of a job's registration the saga needs (policy when no spare)."""

    model_config = ConfigDict(frozen=True)
    cluster: str = "local"
    world_size: int = 1
    policy: JobPolicy = JobPolicy.WAIT
    wait_timeout_s: float = 60.0
    allow_shrink: bool = False


class Timing(BaseModel):
    """The saga's deadlines and retry intervals (from the executor's settings)."""

    model_config = ConfigDict(frozen=True)
    join_timeout_s: float = 60.0
    resume_timeout_s: float = 30.0
    reserve_timeout_s: float = 10.0
    retry_s: float = 1.0
    max_attempts: int = 3


class SagaState(BaseModel):
    """The persisted state of one migration."""

    model_config = ConfigDict(frozen=True)

    migration_id: str
    incident_id: str
    job_id: str
    tenant: str
    rank: int
    mode: MigrationMode
    fault_kind: FaultKind
    failed_member: str  # the member the incident is about
    failed_node: str
    failed_gpu: int
    terms: JobTerms
    phase: Phase = Phase.RESERVE
    # The member that holds the rank now and is to be replaced: the failed member, or a
    # spare of an earlier attempt that never resumed.
    holder_member: str
    generation_before: int
    generation_after: int | None = None
    members_after: list[str] = Field(default_factory=list)  # who holds a rank in g+1
    # Where the rank went, when a later migration replaced our spare (else the lease's slot).
    moved_to: tuple[str, int] | None = None
    attempt: int = 1
    lease: Lease | None = None
    spare_member: str | None = None
    phase_since: datetime
    deadline: datetime | None = None
    next_try_at: datetime | None = None
    wait_until: datetime | None = None
    outcome: Literal["completed", "failed"] | None = None
    fallback: Resolution | None = None
    reason: str = ""
    stats: ResumeStats | None = None
    # Compensations pending: persisted first, carried out by the runner, then removed.
    to_release: list[str] = Field(default_factory=list)
    to_quarantine: list[SlotRef] = Field(default_factory=list)
    to_fence: list[str] = Field(default_factory=list)
    fenced_members: list[str] = Field(default_factory=list)  # fenced by a compensation
    # W3C trace context of the request: every later step of the saga continues its trace,
    # so one failure stays one trace across the executor's timer-driven steps.
    trace: dict[str, str] = Field(default_factory=dict)
    history: list[dict[str, Any]] = Field(default_factory=list)
    created_at: datetime
    updated_at: datetime


MAX_HISTORY = 50


def _move(
    state: SagaState, phase: Phase, now: datetime, note: str = "", **changes: Any
) -> SagaState:
    entry = {
        "at": now.isoformat(),
        "phase": phase.value,
        "attempt": changes.get("attempt", state.attempt),
    }
    if note:
        entry["note"] = note
    last = state.history[-1] if state.history else {}
    repeated = last.get("phase") == entry["phase"] and last.get("note") == entry.get("note")
    # A poll that finds nothing new (waiting for a spare) does not grow the history.
    history = state.history if repeated else [*state.history, entry][-MAX_HISTORY:]
    fields: dict[str, Any] = {
        "phase": phase,
        "phase_since": now,
        "updated_at": now,
        "deadline": None,
        "next_try_at": None,
        "history": history,
    }
    fields.update(changes)
    return state.model_copy(update=fields)


def start(request: MigrationRequested, terms: JobTerms, now: datetime) -> SagaState:
    """The saga a ``MigrationRequested`` starts: first, reserve a spare."""
    return SagaState(
        migration_id=request.migration_id,
        incident_id=request.incident_id,
        job_id=request.job_id,
        tenant=request.tenant,
        rank=request.rank,
        mode=request.mode,
        fault_kind=request.fault_kind,
        failed_member=request.member_id,
        failed_node=request.node,
        failed_gpu=request.gpu,
        terms=terms,
        holder_member=request.member_id,
        generation_before=request.generation_before,
        phase=Phase.RESERVE,
        phase_since=now,
        created_at=now,
        updated_at=now,
        history=[{"at": now.isoformat(), "phase": Phase.RESERVE.value, "attempt": 1}],
    )


def reserved(state: SagaState, lease: Lease, now: datetime, timing: Timing) -> SagaState:
    """A spare was reserved: a hot spare is published at once, a cold slot is spawned."""
    del timing
    if lease.slot.member_id:
        return _move(
            state,
            Phase.PUBLISH,
            now,
            f"hot spare {lease.slot.member_id}",
            lease=lease,
            spare_member=lease.slot.member_id,
        )
    return _move(
        state, Phase.SPAWN, now, f"cold slot {lease.slot.slot_id}", lease=lease, spare_member=None
    )


def pool_unreachable(state: SagaState, now: datetime, timing: Timing) -> SagaState:
    """The spare pool did not answer: ask again shortly, until the reserve deadline."""
    if now - state.phase_since >= timedelta(seconds=timing.reserve_timeout_s):
        return no_spare(state, now, timing, "spare pool unreachable")
    return state.model_copy(
        update={"next_try_at": now + timedelta(seconds=timing.retry_s), "updated_at": now}
    )


def no_spare(state: SagaState, now: datetime, timing: Timing, reason: str) -> SagaState:
    """No spare can be had: the job's policy decides (docs/design.md §3, last paragraph)."""
    terms = state.terms
    if terms.policy == JobPolicy.WAIT:
        wait_until = state.wait_until or now + timedelta(seconds=terms.wait_timeout_s)
        if now < wait_until:
            return _move(
                state,
                Phase.WAIT_SPARE,
                now,
                f"waiting for a spare: {reason}",
                wait_until=wait_until,
                next_try_at=now + timedelta(seconds=timing.retry_s),
            )
        # Past the wait the job's fallback runs: shrink where the user allowed it, else
        # the restart from its checkpoint (the launcher restarts it if it has one).
        waited = f"no spare within {terms.wait_timeout_s:g}s: {reason}"
        if terms.allow_shrink and terms.world_size > 1:
            return _move(state, Phase.SHRINK, now, f"shrinking: {waited}")
        return fail(state, Resolution.CHECKPOINT_RESTART, now, waited)
    if terms.policy == JobPolicy.SHRINK and terms.allow_shrink and terms.world_size > 1:
        return _move(state, Phase.SHRINK, now, f"shrinking: {reason}")
    return fail(state, Resolution.CHECKPOINT_RESTART, now, f"no spare: {reason}")


def still_waiting(state: SagaState, now: datetime, timing: Timing) -> SagaState:
    """Policy wait: no spare yet; ask again later or give up at ``wait_until``."""
    return no_spare(state, now, timing, "none available")


def spawned(state: SagaState, member_id: str, now: datetime, timing: Timing) -> SagaState:
    """The launcher started a spare in the cold slot: wait for its JOINED report."""
    return _move(
        state,
        Phase.AWAIT_JOIN,
        now,
        f"spawned {member_id}",
        spare_member=member_id,
        deadline=now + timedelta(seconds=timing.join_timeout_s),
    )


def joined(state: SagaState, now: datetime) -> SagaState:
    """The spawned spare joined: publish the generation that names it."""
    return _move(state, Phase.PUBLISH, now, f"{state.spare_member} joined")


def published(state: SagaState, generation: Generation, now: datetime, timing: Timing) -> SagaState:
    """Generation g+1 is in the KV bucket: wait for every rank to resume in it."""
    return _move(
        state,
        Phase.AWAIT_RESUME,
        now,
        f"generation {generation.generation} published",
        generation_before=generation.generation - 1,
        generation_after=generation.generation,
        members_after=[a.member_id for a in generation.ranks],
        deadline=now + timedelta(seconds=timing.resume_timeout_s),
    )


_TOO_LATE_TO_ESCALATE = frozenset(
    {
        Phase.CONFIRM,
        Phase.QUARANTINE,
        Phase.FENCE,
        Phase.COMPLETE,
        Phase.FAIL,
        Phase.DONE,
        Phase.SHRINK,
    }
)


def escalate(state: SagaState, now: datetime) -> SagaState:
    """A fatal fault hit the leaving rank of a boundary migration: switch to immediate.

    Before the generation is written, it is simply written immediate. Once a boundary
    generation is out, the ranks may wait forever for a step the dead rank cannot finish,
    so the same assignment is written again as a newer, immediate generation.
    """
    if state.mode == MigrationMode.IMMEDIATE or state.phase in _TOO_LATE_TO_ESCALATE:
        return state
    if state.phase == Phase.AWAIT_RESUME:
        return _move(
            state, Phase.ESCALATE, now, "escalated to immediate", mode=MigrationMode.IMMEDIATE
        )
    return state.model_copy(update={"mode": MigrationMode.IMMEDIATE, "updated_at": now})


def republished(
    state: SagaState, generation: Generation, now: datetime, timing: Timing
) -> SagaState:
    """The immediate copy of our generation is out: wait for the ranks to resume in it."""
    return _move(
        state,
        Phase.AWAIT_RESUME,
        now,
        f"generation {generation.generation} published (immediate)",
        generation_after=generation.generation,
        members_after=[a.member_id for a in generation.ranks],
        deadline=now + timedelta(seconds=timing.resume_timeout_s),
    )


def superseded(
    state: SagaState, newest: Generation, holder: RankAssignment, now: datetime, timing: Timing
) -> SagaState:
    """Our spare failed before it resumed and a later migration gave the rank to another.

    The rank is live again in ``newest``: this migration follows it there and completes
    when every rank of ``newest`` resumed. Our lease is released (that spare is gone; the
    later migration quarantines its slot), and our spare is the later migration's to fence.
    """
    release = [*state.to_release, state.lease.lease_id] if state.lease else state.to_release
    return _move(
        state,
        Phase.AWAIT_RESUME,
        now,
        f"{state.spare_member} replaced by {holder.member_id} in generation {newest.generation}",
        lease=None,
        to_release=release,
        spare_member=holder.member_id,
        moved_to=(holder.node, holder.gpu),
        generation_after=newest.generation,
        members_after=[a.member_id for a in newest.ranks],
        deadline=now + timedelta(seconds=timing.resume_timeout_s),
    )


def destination(state: SagaState) -> tuple[str, int]:
    """The (node, gpu) the rank moved to."""
    if state.moved_to is not None:
        return state.moved_to
    if state.lease is None:
        raise ValueError(f"migration {state.migration_id} has no destination yet")
    return state.lease.slot.node, state.lease.slot.gpu


def resumed(state: SagaState, stats: ResumeStats, now: datetime) -> SagaState:
    """Every rank resumed in g+1: confirm the lease."""
    return _move(state, Phase.CONFIRM, now, "all ranks resumed", stats=stats, outcome="completed")


def confirmed(state: SagaState, now: datetime) -> SagaState:
    """The lease is confirmed: take the failed slot out of service."""
    return _move(state, Phase.QUARANTINE, now)


# The fault kinds whose action in docs/design.md §5 includes quarantine: the GPU itself is bad.
QUARANTINE_KINDS = frozenset(
    {FaultKind.GPU_LOST, FaultKind.UNCORRECTABLE_MEMORY, FaultKind.MEMORY_UNREPAIRABLE}
)


def should_quarantine(kind: FaultKind) -> bool:
    """Whether the failed slot leaves service after the migration (docs/design.md §5's table).

    A lost or hung process, a straggler or a warning that a reset clears says nothing bad
    about the GPU (the detector escalates repeats and lemons itself, through node health);
    a planned drain leaves a healthy slot, which the drain has already taken out.
    """
    return kind in QUARANTINE_KINDS


def quarantined(state: SagaState, now: datetime) -> SagaState:
    """The old slot is out of service: fence the old member."""
    return _move(state, Phase.FENCE, now)


def fenced(state: SagaState, now: datetime) -> SagaState:
    """The old member is fenced: report the outcome."""
    if state.outcome == "completed":
        return _move(state, Phase.COMPLETE, now)
    return _move(state, Phase.FAIL, now)


def shrunk(state: SagaState, generation: Generation, now: datetime) -> SagaState:
    """The job runs on without the rank: quarantine, fence, then report ``shrunk``."""
    return _move(
        state,
        Phase.QUARANTINE,
        now,
        f"shrunk to generation {generation.generation}",
        outcome="failed",
        fallback=Resolution.SHRUNK,
        reason="no spare: shrunk the job by one rank",
        generation_before=generation.generation - 1,
        generation_after=generation.generation,
        members_after=[a.member_id for a in generation.ranks],
    )


def done(state: SagaState, now: datetime) -> SagaState:
    """The outcome is published."""
    return _move(state, Phase.DONE, now)


def fail(state: SagaState, fallback: Resolution, now: datetime, reason: str) -> SagaState:
    """Give up on migrating: release the lease (if any) and report the fallback."""
    release = [*state.to_release, state.lease.lease_id] if state.lease else state.to_release
    return _move(
        state,
        Phase.FAIL,
        now,
        reason,
        outcome="failed",
        fallback=fallback,
        reason=reason,
        lease=None,
        to_release=release,
    )


def timed_out(state: SagaState, now: datetime, timing: Timing, reason: str) -> SagaState:
    """A wait passed its deadline (or a spare could not be started): compensate.

    The lease is released; a spare that was already named in a published generation is
    fenced and its slot quarantined, and the rank is replaced again from there. After
    ``max_attempts`` the job's policy decides as if no spare could be had.
    """
    if state.moved_to is not None:
        # Following another migration's spare: that one is its saga's to replace, not ours.
        return fail(
            state,
            Resolution.LOST,
            now,
            f"rank {state.rank} did not resume in generation {state.generation_after}: {reason}",
        )
    release = [*state.to_release, state.lease.lease_id] if state.lease else state.to_release
    changes: dict[str, Any] = {"lease": None, "to_release": release, "spare_member": None}
    if state.phase == Phase.AWAIT_RESUME and state.spare_member and state.generation_after:
        # The rank now belongs to the spare that never resumed: it is the one to replace.
        changes["holder_member"] = state.spare_member
        changes["generation_before"] = state.generation_after
        changes["generation_after"] = None
        changes["to_fence"] = [*state.to_fence, state.spare_member]
        if state.lease is not None:
            slot = state.lease.slot
            changes["to_quarantine"] = [
                *state.to_quarantine,
                SlotRef(
                    node=slot.node,
                    gpu=slot.gpu,
                    cluster=slot.cluster,
                    reason=f"spare {state.spare_member} did not resume: {reason}",
                ),
            ]
    elif state.phase == Phase.AWAIT_JOIN and state.spare_member:
        changes["to_fence"] = [*state.to_fence, state.spare_member]
    attempt = state.attempt + 1
    if attempt > timing.max_attempts:
        moved = state.model_copy(update={**changes, "attempt": attempt})
        return no_spare(
            moved.model_copy(update={"wait_until": moved.wait_until or now}),
            now,
            timing,
            f"{timing.max_attempts} attempts failed: {reason}",
        )
    return _move(state, Phase.RESERVE, now, f"compensated: {reason}", attempt=attempt, **changes)


def aborted(state: SagaState, now: datetime, reason: str) -> SagaState:
    """The job ended while the migration was under way: release what was taken."""
    if state.phase not in ABORTABLE:
        return state
    if state.mode == MigrationMode.BOUNDARY:
        # A warning (straggler, remap pending, drain) on a job that ended before the rank
        # moved: no failure reached the job, so it must not count against the guarantee.
        return fail(state, Resolution.EXCLUDED, now, f"job ended before the move: {reason}")
    return fail(state, Resolution.LOST, now, reason)


def compensated(
    state: SagaState,
    *,
    released: str | None = None,
    quarantined_slot: SlotRef | None = None,
    fenced_member: str | None = None,
) -> SagaState:
    """Drop one carried-out compensation from the pending lists."""
    return state.model_copy(
        update={
            "to_release": [x for x in state.to_release if x != released],
            "to_quarantine": [x for x in state.to_quarantine if x != quarantined_slot],
            "to_fence": [x for x in state.to_fence if x != fenced_member],
            "fenced_members": [*state.fenced_members, fenced_member]
            if fenced_member
            else state.fenced_members,
        }
    )


def members_to_fence(state: SagaState) -> list[str]:
    """Who the FENCE phase tells the launcher to kill: the replaced members not yet fenced."""
    wanted = dict.fromkeys([state.failed_member, state.holder_member])
    return [m for m in wanted if m not in state.fenced_members]


def waiting_for(state: SagaState, now: datetime) -> bool:
    """True while the saga has nothing to do before ``next_try_at``."""
    return state.next_try_at is not None and now < state.next_try_at


# --------------------------------------------------------------------------- plans


def resume_stats(
    members: list[str],
    newcomer: str | None,
    reports: dict[str, dict[str, Any]],
    *,
    partial: bool = False,
) -> ResumeStats | None:
    """The migration's figures once every member of the new generation RESUMED, else None.

    stall_ms is the longest stall among the survivors (every member but the newcomer, whose
    "stall" is its start-up); a world of one has no survivor and takes the newcomer's.
    lost_steps is the largest, bytes_moved the sum of what every rank received. With
    ``partial``, the figures of the members that did report, as long as the newcomer did.
    """
    got = [reports.get(m) for m in members]
    if not got:
        return None
    if partial:
        if newcomer is not None and newcomer not in reports:
            return None
    elif any(r is None for r in got):
        return None
    present = [r for r in got if r is not None]
    survivors = [reports[m] for m in members if m != newcomer and m in reports]
    pool = survivors or present
    return ResumeStats(
        stall_ms=max(float(r.get("stall_ms") or 0.0) for r in pool),
        lost_steps=max(int(r.get("lost_steps") or 0) for r in present),
        bytes_moved=sum(int(r.get("bytes_received") or 0) for r in present),
    )


def shrink_generation(
    current: Generation, rank: int, store_addrs: dict[str, str], migration_id: str, reason: str
) -> Generation:
    """Generation g+1 without ``rank``: the ranks above it move down by one.

    Raises:
        ValueError: the rank is not in the generation, it is the only one, or the new
            store host's address is unknown.
    """
    leaving = next((a for a in current.ranks if a.rank == rank), None)
    if leaving is None:
        raise ValueError(f"generation {current.generation} has no rank {rank}")
    rest = sorted((a for a in current.ranks if a.rank != rank), key=lambda a: a.rank)
    if not rest:
        raise ValueError("cannot shrink a job of one rank")
    ranks = [
        RankAssignment(rank=i, member_id=a.member_id, node=a.node, gpu=a.gpu)
        for i, a in enumerate(rest)
    ]
    host = ranks[0].member_id
    addr = current.store_addr if host == current.store_member else store_addrs.get(host)
    if not addr:
        raise ValueError(f"no store address known for {host}")
    return Generation(
        job_id=current.job_id,
        generation=current.generation + 1,
        world_size=len(ranks),
        ranks=ranks,
        store_member=host,
        store_addr=addr,
        mode=MigrationMode.IMMEDIATE,
        departing=[leaving.member_id],
        reason=reason,
        migration_id=migration_id,
    )
