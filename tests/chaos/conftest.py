"""Fixtures of the chaos suite and the table it prints at the end of the session.

One supervised stack for the session (a module whose scenarios break a server gets its own),
one contract for tenant ``acme`` per stack, and one fault-free reference run per job
configuration for the whole session.

``make test`` runs the core scenarios; the ones marked ``chaos_extended`` run only when the
chaos suite is asked for by path (``make chaos`` = ``pytest tests/chaos``) or with
``TORCHRELAY_CHAOS=all``, to keep ``make test`` within CI's time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.chaos import chaoslib
from tests.harness import Stack, digests, start_stack, stop_stack

CHAOS_DIR = Path(__file__).resolve().parent


@dataclass
class Row:
    runs: int = 0
    passed: int = 0
    invariants: int = 0


@dataclass
class Table:
    rows: dict[str, Row] = field(default_factory=dict)


TABLE = Table()
RECORDERS: dict[str, chaoslib.Recorder] = {}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "chaos_extended: chaos scenario run by `make chaos` only (not `make test`)"
    )


def _chaos_asked_for(config: pytest.Config) -> bool:
    if os.environ.get("TORCHRELAY_CHAOS") == "all":
        return True
    for arg in config.args:
        path = Path(arg.split("::")[0]).resolve()
        if path == CHAOS_DIR or CHAOS_DIR in path.parents:
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _chaos_asked_for(config):
        return
    skip = pytest.mark.skip(reason="extended chaos scenario: run `make chaos`")
    for item in items:
        if item.get_closest_marker("chaos_extended"):
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not item.get_closest_marker("chaos") or report.skipped:
        return
    if report.when == "call" or (report.when == "setup" and report.failed):
        row = TABLE.rows.setdefault(item.name, Row())
        row.runs += 1
        row.passed += int(report.passed)
        rec = RECORDERS.get(item.nodeid)
        row.invariants += len(rec.checked) if rec else 0


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not TABLE.rows:
        return
    width = max(len("scenario"), *(len(n) for n in TABLE.rows))
    tr = terminalreporter
    tr.write_sep("=", "chaos scenarios")
    tr.write_line(f"{'scenario':<{width}}  runs  passed  invariants checked")
    for name, row in TABLE.rows.items():
        tr.write_line(f"{name:<{width}}  {row.runs:>4}  {row.passed:>6}  {row.invariants:>18}")
    total = Row(
        sum(r.runs for r in TABLE.rows.values()),
        sum(r.passed for r in TABLE.rows.values()),
        sum(r.invariants for r in TABLE.rows.values()),
    )
    tr.write_line(f"{'total':<{width}}  {total.runs:>4}  {total.passed:>6}  {total.invariants:>18}")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def chaos_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A supervised stack (both servers, six services) shared by the scenarios that leave it
    whole (a module that breaks a server overrides this with its own)."""
    s = start_stack(tmp_path_factory.mktemp("chaos-stack"), chaoslib.STACK_ENV)
    try:
        yield s
    finally:
        stop_stack(s)


@pytest.fixture(scope="module")
def contract_id(chaos_stack: Stack) -> str:
    """Tenant ``acme``'s guarantee contract on this module's stack."""
    return chaoslib.ensure_contract(chaos_stack)


class References:
    """Fault-free final digests per job configuration, computed once per session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[str, dict[int, str]] = {}

    def get(self, stack: Stack, spares: int = 1) -> dict[int, str]:
        # The digests depend on the ranks, steps and width, not on the spares or the sleep.
        key = f"n{chaoslib.NPROC}-s{chaoslib.STEPS}"
        if key not in self.cache:
            job = chaoslib.start_job(stack, self.root, f"ref-{key}", spares=spares)
            chaoslib.wait_job_ok(job)
            got = digests(job.out)
            assert len(got) == chaoslib.NPROC, f"reference run wrote {got}"
            assert len(set(got.values())) == 1, f"ranks of the reference disagree: {got}"
            self.cache[key] = got
        return self.cache[key]


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(tmp_path_factory.mktemp("chaos-ref"))


@pytest.fixture
def rec(request: pytest.FixtureRequest) -> chaoslib.Recorder:
    """The invariants this scenario checked (counted in the session's table)."""
    r = chaoslib.Recorder()
    RECORDERS[request.node.nodeid] = r
    return r
