"""The scheduler's decision rules, without servers."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler import rules
from services.scheduler.rules import Decision, RankPlacement
from torchrelay.contract import (
    FaultAction,
    FaultDetected,
    FaultKind,
    MigrationCompleted,
    MigrationFailed,
    MigrationMode,
    Resolution,
    Severity,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def fault(**kw: object) -> FaultDetected:
    base: dict[str, object] = {
        "event_id": "e1",
        "source": "detector",
        "fault_id": "f1",
        "cluster": "local",
        "node": "local-0",
        "gpu": 0,
        "kind": FaultKind.WORKER_LOST,
        "severity": Severity.FATAL,
        "action": FaultAction.MIGRATE_NOW,
        "first_seen_at": T0,
    }
    base.update(kw)
    return FaultDetected.model_validate(base)


def place(job: str, rank: int, node: str, gpu: int, gen: int = 1) -> RankPlacement:
    return RankPlacement(
        job_id=job,
        tenant="acme",
        cluster="local",
        rank=rank,
        member_id=f"{job}-w{rank}",
        node=node,
        gpu=gpu,
        generation=gen,
    )


PLACEMENTS = [
    place("a", 0, "local-0", 0),
    place("a", 1, "local-0", 1),
    place("a", 2, "local-1", 0),
    place("b", 0, "local-0", 1),
    place("b", 1, "local-1", 1),
]


@pytest.mark.parametrize(
    ("kind", "severity", "action", "expected"),
    [
        (FaultKind.WORKER_LOST, Severity.FATAL, FaultAction.MIGRATE_NOW, Decision.MIGRATE_NOW),
        (FaultKind.GPU_LOST, Severity.FATAL, FaultAction.QUARANTINE, Decision.MIGRATE_NOW),
        (
            FaultKind.ROW_REMAP_PENDING,
            Severity.WARNING,
            FaultAction.MIGRATE_AT_BOUNDARY,
            Decision.MIGRATE_AT_BOUNDARY,
        ),
        (
            FaultKind.THERMAL_SLOWDOWN,
            Severity.WARNING,
            FaultAction.MIGRATE_AT_BOUNDARY,
            Decision.MIGRATE_AT_BOUNDARY,
        ),
        (
            FaultKind.PLANNED_DRAIN,
            Severity.INFO,
            FaultAction.MIGRATE_AT_BOUNDARY,
            Decision.MIGRATE_AT_BOUNDARY,
        ),
        (FaultKind.APPLICATION_ERROR, Severity.FATAL, FaultAction.RECORD, Decision.RECORD),
        (FaultKind.APPLICATION_ERROR, Severity.FATAL, FaultAction.MIGRATE_NOW, Decision.RECORD),
        (FaultKind.STRAGGLER, Severity.INFO, FaultAction.RECORD, Decision.RECORD),
        (FaultKind.STRAGGLER, Severity.INFO, FaultAction.QUARANTINE, Decision.RECORD),
    ],
)
def test_decision_table(
    kind: FaultKind, severity: Severity, action: FaultAction, expected: Decision
) -> None:
    assert rules.decide(kind, severity, action) == expected


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(FaultKind), st.sampled_from(Severity), st.sampled_from(FaultAction))
def test_decision_properties(kind: FaultKind, severity: Severity, action: FaultAction) -> None:
    decision = rules.decide(kind, severity, action)
    if kind == FaultKind.APPLICATION_ERROR or action == FaultAction.RECORD:
        assert decision == Decision.RECORD  # never charge the infrastructure
    elif kind == FaultKind.PLANNED_DRAIN:
        assert decision == Decision.MIGRATE_AT_BOUNDARY  # planned work never abandons a step
    elif severity == Severity.FATAL:
        assert decision == Decision.MIGRATE_NOW
    if decision != Decision.RECORD:
        assert rules.migration_mode(decision) in (MigrationMode.IMMEDIATE, MigrationMode.BOUNDARY)


def test_record_decision_has_no_mode() -> None:
    with pytest.raises(ValueError, match="does not migrate"):
        rules.migration_mode(Decision.RECORD)


def test_worker_fault_hits_the_rank_the_member_holds_now() -> None:
    hurt = rules.affected_ranks(fault(job_id="a", member_id="a-w2", node="x"), PLACEMENTS)
    assert [(p.job_id, p.rank) for p in hurt] == [("a", 2)]


def test_fault_of_a_member_that_no_longer_holds_a_rank_hurts_nobody() -> None:
    # An old, fenced process dying after its migration must not start another one.
    assert rules.affected_ranks(fault(job_id="a", member_id="a-w9"), PLACEMENTS) == []


def test_worker_fault_by_rank_when_member_unknown() -> None:
    hurt = rules.affected_ranks(fault(job_id="b", rank=1), PLACEMENTS)
    assert [(p.job_id, p.rank) for p in hurt] == [("b", 1)]


def test_gpu_fault_hits_every_job_on_that_slot_only() -> None:
    hurt = rules.affected_ranks(fault(node="local-0", gpu=1), PLACEMENTS)
    assert [(p.job_id, p.rank) for p in hurt] == [("a", 1), ("b", 0)]


def test_node_fault_hits_every_rank_on_the_node() -> None:
    hurt = rules.affected_ranks(fault(node="local-1", gpu=None), PLACEMENTS)
    assert [(p.job_id, p.rank) for p in hurt] == [("a", 2), ("b", 1)]


def test_fault_on_other_cluster_hits_nobody() -> None:
    assert rules.affected_ranks(fault(cluster="east", node="local-0", gpu=0), PLACEMENTS) == []


def test_ids_are_deterministic_and_distinct_per_rank() -> None:
    a = rules.incident_id_for("f1", "a", 0)
    assert a == rules.incident_id_for("f1", "a", 0)
    assert a != rules.incident_id_for("f1", "a", 1)
    assert rules.migration_id_for(a) == rules.migration_id_for(a)


def test_open_incident_carries_placement_and_fault() -> None:
    inc = rules.open_incident(fault(), PLACEMENTS[1])
    assert (inc.job_id, inc.rank, inc.node, inc.gpu, inc.tenant) == ("a", 1, "local-0", 1, "acme")
    assert inc.resolution == Resolution.OPEN
    assert inc.generation_before == 1
    assert inc.fault_id == "f1"


def _completed(mode: MigrationMode) -> MigrationCompleted:
    return MigrationCompleted(
        event_id="m",
        source="migration_executor",
        migration_id="m1",
        incident_id="i",
        job_id="a",
        rank=1,
        mode=mode,
        to_node="local-2",
        to_gpu=0,
        generation_before=1,
        generation_after=2,
        stall_ms=57.5,
        lost_steps=1,
        bytes_moved=1234,
        occurred_at=T0,
    )


@pytest.mark.parametrize(
    ("mode", "resolution"),
    [
        (MigrationMode.IMMEDIATE, Resolution.MIGRATED_LIVE),
        (MigrationMode.BOUNDARY, Resolution.MIGRATED_PROACTIVE),
    ],
)
def test_completed_migration_closes_with_agents_figures(
    mode: MigrationMode, resolution: Resolution
) -> None:
    closed = rules.close_completed(rules.open_incident(fault(), PLACEMENTS[1]), _completed(mode))
    assert closed.resolution == resolution
    assert (closed.stall_ms, closed.lost_steps, closed.bytes_moved) == (57.5, 1, 1234)
    assert (closed.generation_before, closed.generation_after) == (1, 2)
    assert closed.resolved_at == T0


@pytest.mark.parametrize(
    ("fallback", "expected"),
    [
        (Resolution.CHECKPOINT_RESTART, Resolution.CHECKPOINT_RESTART),
        (Resolution.SHRUNK, Resolution.SHRUNK),
        (Resolution.LOST, Resolution.LOST),
        # A failed migration is never recorded as a success, whatever the message says.
        (Resolution.MIGRATED_LIVE, Resolution.LOST),
        (Resolution.OPEN, Resolution.LOST),
    ],
)
def test_failed_migration_closes_with_fallback(fallback: Resolution, expected: Resolution) -> None:
    failed = MigrationFailed(
        event_id="x",
        source="migration_executor",
        migration_id="m",
        incident_id="i",
        job_id="a",
        reason="no spare",
        fallback=fallback,
        occurred_at=T0,
    )
    closed = rules.close_failed(rules.open_incident(fault(), PLACEMENTS[0]), failed)
    assert closed.resolution == expected
    assert closed.resolved_at == T0


def test_recorded_incident_is_excluded() -> None:
    inc = rules.open_incident(fault(kind=FaultKind.APPLICATION_ERROR), PLACEMENTS[0])
    closed = rules.close_recorded(inc, T0)
    assert closed.resolution == Resolution.EXCLUDED
    assert closed.resolved_at == T0
