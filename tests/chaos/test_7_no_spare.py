"""Scenario 7: no spare available: the job's policy fallback is taken and recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos import chaoslib
from tests.harness import Stack

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.mark.parametrize(
    ("policy", "run_args"),
    [
        pytest.param(
            "wait", ["--wait-timeout", "3"], id="wait-timeout", marks=pytest.mark.chaos_extended
        ),
        pytest.param(
            "checkpoint_restart", [], id="checkpoint_restart", marks=pytest.mark.chaos_extended
        ),
    ],
)
def test_no_spare_takes_the_fallback(
    policy: str,
    run_args: list[str],
    chaos_stack: Stack,
    contract_id: str,
    rec: chaoslib.Recorder,
    tmp_path: Path,
) -> None:
    before = chaoslib.baseline(chaos_stack, contract_id)
    job = chaoslib.start_job(
        chaos_stack,
        tmp_path,
        f"no-spare-{policy.replace('_', '-')}",
        spares=0,
        policy=policy,
        run_args=run_args,
    )
    try:
        chaoslib.wait_mid_run(chaos_stack, job)
        chaoslib.kill_rank(chaos_stack, job.job_id, 2)
        # The fallback is recorded on the incident; the launcher then gives the job up (or is
        # stopped here, as an operator would restart it from its checkpoint).
        chaoslib.wait_until_closed(chaos_stack, job.job_id)
    finally:
        job.stop()
    chaoslib.check_invariants(
        chaos_stack,
        contract_id,
        before,
        job,
        [chaoslib.Expect(rank=2, resolutions=frozenset({"checkpoint_restart"}))],
        rec,
    )
