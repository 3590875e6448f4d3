"""The scheduler's and executor's public surface: what other code may import by name."""

from __future__ import annotations

import services.migration_executor as executor
import services.scheduler as scheduler


def test_public_surface_is_pinned() -> None:
    assert sorted(scheduler.__all__) == ["Decision", "decide"]
    assert sorted(executor.__all__) == ["Phase", "SagaState"]
    for module in (scheduler, executor):
        for name in module.__all__:
            assert getattr(module, name) is not None
