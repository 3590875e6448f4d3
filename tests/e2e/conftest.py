"""Fixtures of the end-to-end tests: one supervised stack for the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import Stack, start_stack, stop_stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One supervised stack (both servers, six services) for the e2e session."""
    s = start_stack(tmp_path_factory.mktemp("stack"))
    yield s
    stop_stack(s)
