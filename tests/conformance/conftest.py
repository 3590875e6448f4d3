"""Fixtures of the conformance matrix: a job runner and the table printed at the end."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conformance.matrix import RESULTS
from tests.integration.agent.conftest import JobRunner
from torchrelay.bus import Bus


@pytest.fixture
async def runner(bus: Bus, nats_url: str, tmp_path: Path) -> AsyncIterator[JobRunner]:
    r = JobRunner(bus, nats_url, tmp_path)
    yield r
    await r.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not RESULTS:
        return
    terminalreporter.section("conformance matrix")
    terminalreporter.write_line(f"{'shape':8} {'fault':28} {'load':6} result")
    for row in RESULTS:
        terminalreporter.write_line(
            f"{row['shape']:8} {row['fault']:28} {row['load']:6} {row['result']}"
        )
