"""Fixtures of the conformance matrix: a job runner and the table printed at the end."""

from __future__ import annotations

import pytest

from tests.conformance.matrix import RESULTS

# The agent tests' job runner: a launched job plus the test executor, stopped at the end.
from tests.integration.agent.conftest import runner  # noqa: F401


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not RESULTS:
        return
    terminalreporter.section("conformance matrix")
    terminalreporter.write_line(f"{'shape':8} {'fault':28} {'load':6} result")
    for row in RESULTS:
        terminalreporter.write_line(
            f"{row['shape']:8} {row['fault']:28} {row['load']:6} {row['result']}"
        )
