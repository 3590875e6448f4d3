"""The scheduler's business rules as pure functions: which ranks a fault hurts, what to do.

Nothing here talks to NATS or Redis; the handlers in ``service.py`` call these and persist
the outcome, so every rule is unit-tested without a server (docs/design.md §3, step 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from torchrelay.contract import (
    FaultAction,
    FaultDetected,
    FaultKind,
    Incident,
    MigrationCompleted,
    MigrationFailed,
    MigrationMode,
    Resolution,
    Severity,
    make_event_id,
)


class Decision(StrEnum):
    """What the scheduler does about one incident."""

    MIGRATE_NOW = "migrate_now"
    MIGRATE_AT_BOUNDARY = "migrate_at_boundary"
    RECORD = "record"


# Kinds that are never the infrastructure's fault: recorded, excluded from the guarantee.
_RECORD_ONLY_KINDS = frozenset({FaultKind.APPLICATION_ERROR})


def decide(kind: FaultKind, severity: Severity, action: FaultAction) -> Decision:
    """The action for a fault that hurts a running rank (docs/design.md §3 and §5).

    Fatal faults migrate now; warnings and planned drains migrate at the next step boundary;
    application errors and informational faults are only recorded. A detector's
    ``migrate_now`` recommendation is honoured even at warning severity (it saw something
    the trend rules did not), and ``record`` is never escalated.
    """
    if kind in _RECORD_ONLY_KINDS or action == FaultAction.RECORD:
        return Decision.RECORD
    if kind == FaultKind.PLANNED_DRAIN:
        return Decision.MIGRATE_AT_BOUNDARY
    if severity == Severity.FATAL or action == FaultAction.MIGRATE_NOW:
        return Decision.MIGRATE_NOW
    if severity == Severity.WARNING or action == FaultAction.MIGRATE_AT_BOUNDARY:
        return Decision.MIGRATE_AT_BOUNDARY
    return Decision.RECORD


def migration_mode(decision: Decision) -> MigrationMode:
    """How the agents switch for a migrating decision."""
    if decision == Decision.MIGRATE_NOW:
        return MigrationMode.IMMEDIATE
    if decision == Decision.MIGRATE_AT_BOUNDARY:
        return MigrationMode.BOUNDARY
    raise ValueError(f"decision {decision} does not migrate")


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank of one job runs in the job's newest generation."""

    job_id: str
    tenant: str
    cluster: str
    rank: int
    member_id: str
    node: str
    gpu: int
    generation: int


def affected_ranks(fault: FaultDetected, placements: list[RankPlacement]) -> list[RankPlacement]:
    """The ranks a fault hurts, given the placements of every active job.

    A fault that names a job (worker faults) hurts the rank that member holds now; a member
    no longer named in its job's generation (an old, fenced process dying) hurts nobody.
    A node or GPU fault hurts every rank placed on that slot, in every job.
    """
    if fault.job_id is not None:
        mine = [p for p in placements if p.job_id == fault.job_id]
        if fault.member_id is not None:
            return [p for p in mine if p.member_id == fault.member_id]
        if fault.rank is not None:
            return [p for p in mine if p.rank == fault.rank]
        return _on_slot(fault, mine)
    return _on_slot(fault, placements)


def _on_slot(fault: FaultDetected, placements: list[RankPlacement]) -> list[RankPlacement]:
    return sorted(
        (
            p
            for p in placements
            if p.cluster == fault.cluster
            and p.node == fault.node
            and (fault.gpu is None or p.gpu == fault.gpu)
        ),
        key=lambda p: (p.job_id, p.rank),
    )


def incident_id_for(fault_id: str, job_id: str, rank: int) -> str:
    """One incident per (fault, job, rank): each hurt rank is migrated on its own."""
    return make_event_id("incident", fault_id, job_id, rank)


def migration_id_for(incident_id: str) -> str:
    """The one migration an incident may start (a redelivery builds the same id)."""
    return make_event_id("migration", incident_id)


def open_incident(
    fault: FaultDetected,
    placement: RankPlacement,
    *,
    kind: FaultKind | None = None,
    severity: Severity | None = None,
) -> Incident:
    """The incident a fault opens on one rank."""
    return Incident(
        incident_id=incident_id_for(fault.fault_id, placement.job_id, placement.rank),
        tenant=placement.tenant,
        job_id=placement.job_id,
        rank=placement.rank,
        node=placement.node,
        gpu=placement.gpu,
        fault_kind=kind or fault.kind,
        severity=severity or fault.severity,
        detected_at=fault.first_seen_at,
        cluster=placement.cluster,
        fault_id=fault.fault_id,
        generation_before=placement.generation,
    )


def completion_resolution(mode: MigrationMode) -> Resolution:
    """A completed migration is live (fatal fault) or proactive (warning, drain)."""
    return (
        Resolution.MIGRATED_LIVE
        if mode == MigrationMode.IMMEDIATE
        else Resolution.MIGRATED_PROACTIVE
    )


def close_completed(incident: Incident, done: MigrationCompleted) -> Incident:
    """The incident closed by a completed migration, with the agents' figures."""
    return incident.model_copy(
        update={
            "resolution": completion_resolution(done.mode),
            "resolved_at": done.occurred_at,
            "stall_ms": done.stall_ms,
            "lost_steps": done.lost_steps,
            "bytes_moved": done.bytes_moved,
            "generation_before": done.generation_before,
            "generation_after": done.generation_after,
        }
    )


_FALLBACKS = frozenset(
    {
        Resolution.CHECKPOINT_RESTART,
        Resolution.SHRUNK,
        Resolution.LOST,
        Resolution.MANUAL,
        Resolution.EXCLUDED,
    }
)


def close_failed(
    incident: Incident, failed: MigrationFailed, generation_after: int | None = None
) -> Incident:
    """The incident closed by a failed migration with the fallback the job's policy took.

    A fallback that is not a failure resolution (a bug or a newer executor) is recorded as
    ``lost`` rather than as a success.
    """
    resolution = failed.fallback if failed.fallback in _FALLBACKS else Resolution.LOST
    return incident.model_copy(
        update={
            "resolution": resolution,
            "resolved_at": failed.occurred_at,
            "generation_after": generation_after,
        }
    )


def close_recorded(incident: Incident, at: datetime) -> Incident:
    """An incident that is only recorded (application error, info) closes at once."""
    return incident.model_copy(update={"resolution": Resolution.EXCLUDED, "resolved_at": at})


def close_unplaced(incident: Incident, at: datetime) -> Incident:
    """A fault on a job that never formed cannot be migrated: it is lost, not excluded."""
    return incident.model_copy(update={"resolution": Resolution.LOST, "resolved_at": at})
