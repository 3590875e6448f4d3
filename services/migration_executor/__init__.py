"""The migration executor: each migration as a persisted, idempotent saga (DESIGN.md §7)."""

from .saga import Phase, SagaState

__all__ = ["Phase", "SagaState"]
