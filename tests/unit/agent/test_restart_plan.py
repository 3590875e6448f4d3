"""Where a checkpoint restart runs: the job's slots but those whose GPU failed, and the
world size it shrinks to when it may (docs/design.md §13)."""

from __future__ import annotations

import pytest

from torchrelay.contract import FaultKind, MigrationFailed, Resolution
from torchrelay.launcher._restart import RestartError, plan_restart, unfit_slot

SLOTS = [("n0", 0), ("n0", 1), ("n1", 0), ("n1", 1)]


def _failed(
    kind: FaultKind | None, node: str | None = "n0", gpu: int | None = 1
) -> MigrationFailed:
    return MigrationFailed(
        event_id="e",
        source="test",
        migration_id="m",
        incident_id="i",
        job_id="j",
        reason="no spare",
        fallback=Resolution.CHECKPOINT_RESTART,
        node=node,
        gpu=gpu,
        fault_kind=kind,
    )


@pytest.mark.parametrize(
    ("kind", "unfit"),
    [
        (FaultKind.GPU_LOST, ("n0", 1)),
        (FaultKind.UNCORRECTABLE_MEMORY, ("n0", 1)),
        (FaultKind.THERMAL_SLOWDOWN, ("n0", 1)),
        (FaultKind.PLANNED_DRAIN, ("n0", None)),
        (FaultKind.WORKER_LOST, None),
        (FaultKind.WORKER_HANG, None),
        (FaultKind.APPLICATION_ERROR, None),
        (None, None),
    ],
)
def test_a_gpu_fault_leaves_its_slot_unfit_a_process_fault_does_not(
    kind: FaultKind | None, unfit: tuple[str, int | None] | None
) -> None:
    assert unfit_slot(_failed(kind)) == unfit


def test_a_failure_without_its_slot_leaves_nothing_unfit() -> None:
    assert unfit_slot(_failed(FaultKind.GPU_LOST, node=None, gpu=None)) is None


def test_every_slot_fit_restarts_on_all_of_them_in_rank_order() -> None:
    plan = plan_restart(SLOTS, [], nproc=4, allow_shrink=False)
    assert plan.slots == SLOTS
    assert plan.left_out == []


def test_a_failed_gpu_without_shrink_is_refused_naming_it_and_the_flag() -> None:
    with pytest.raises(RestartError, match=r"needs 4 slots and 3 are fit \(GPU 1 of node n0"):
        plan_restart(SLOTS, [("n0", 1)], nproc=4, allow_shrink=False)
    with pytest.raises(RestartError, match="--allow-shrink"):
        plan_restart(SLOTS, [("n0", 1)], nproc=4, allow_shrink=False)


@pytest.mark.parametrize(
    ("unfit", "nproc", "slots"),
    [
        # 3 fit of 4: the largest divisor of 4 that fits is 2.
        ([("n0", 1)], 4, [("n0", 0), ("n1", 0)]),
        # A drained node takes both its GPUs.
        ([("n0", None)], 4, [("n1", 0), ("n1", 1)]),
        # 3 ranks: 2 fit, 3 is not divisible by 2, so 1.
        ([("n0", 1)], 3, [("n0", 0)]),
        # 6 ranks, one lost: 5 fit, largest divisor of 6 that fits is 3.
        ([("n0", 1)], 6, [("n0", 0), ("n1", 0), ("n1", 1)]),
    ],
)
def test_shrink_takes_the_largest_world_size_dividing_nproc_that_fits(
    unfit: list[tuple[str, int | None]], nproc: int, slots: list[tuple[str, int]]
) -> None:
    all_slots = SLOTS if nproc <= 4 else [*SLOTS, ("n2", 0), ("n2", 1)]
    all_slots = all_slots[:nproc]
    plan = plan_restart(all_slots, unfit, nproc=nproc, allow_shrink=True)
    assert plan.slots == slots
    assert set(plan.slots) | set(plan.left_out) == set(all_slots)
    assert plan.world_before == nproc


def test_no_fit_slot_is_refused_even_with_shrink() -> None:
    with pytest.raises(RestartError, match="no slot of the job is fit"):
        plan_restart(SLOTS[:2], [("n0", None)], nproc=2, allow_shrink=True)
