"""Live migration of a rank to a hot spare, bitwise-exact, on real multi-process gloo jobs."""

from __future__ import annotations

import pytest

from tests.integration.agent.conftest import JobRunner
from torchrelay.contract import ReportKind

pytestmark = pytest.mark.slow

ENV = {"TR_STEPS": "20", "TR_STEP_SLEEP_S": "0.02"}


async def test_fault_free_job_finishes_with_equal_states(runner: JobRunner) -> None:
    job, ex = await runner.start("clean", nproc=2, spares=1, env=ENV)
    code = await job.wait()
    assert code == 0, job.output()[-3000:]
    digests = job.digests()
    assert sorted(digests) == [0, 1]
    resumed = ex.of(ReportKind.RESUMED, generation=1)
    assert len(resumed) == 2
