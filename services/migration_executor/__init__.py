"""The migration executor: each migration as a persisted, idempotent saga (docs/design.md §7)."""

from .saga import Phase, SagaState

__all__ = ["Phase", "SagaState"]
