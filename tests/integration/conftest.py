"""Fixtures the control-plane integration tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.integration.migration_executor.harness import EventTap
from torchrelay.bus import Bus


@pytest.fixture
async def tap(bus: Bus) -> AsyncIterator[EventTap]:
    """Every event on the bus, recorded from the test's start (``tap.wait``, ``tap.of``)."""
    t = EventTap()
    await t.start(bus)
    yield t
    await t.stop()
