"""Scenario 4: failures that overlap.

- Two ranks failing at once (two spares).
- A second failure while the first migration runs.
- The spare dying while it joins (a second spare takes the rank).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.chaos import chaoslib
from tests.chaos.conftest import References
from tests.harness import Stack

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.mark.chaos_extended
def test_two_ranks_at_once(
    chaos_stack: Stack,
    contract_id: str,
    references: References,
    rec: chaoslib.Recorder,
    tmp_path: Path,
) -> None:
    reference = references.get(chaos_stack)
    before = chaoslib.baseline(chaos_stack, contract_id)
    job = chaoslib.start_job(chaos_stack, tmp_path, "two-at-once", spares=2)
    try:
        chaoslib.wait_mid_run(chaos_stack, job)
        chaoslib.kill_rank(chaos_stack, job.job_id, 1)
        chaoslib.kill_rank(chaos_stack, job.job_id, 2)
        chaoslib.wait_job_ok(job)
    finally:
        job.stop()
    chaoslib.check_invariants(
        chaos_stack,
        contract_id,
        before,
        job,
        [chaoslib.Expect(rank=1), chaoslib.Expect(rank=2)],
        rec,
        reference=reference,
    )


@pytest.mark.chaos_extended
def test_failure_during_migration(
    chaos_stack: Stack,
    contract_id: str,
    references: References,
    rec: chaoslib.Recorder,
    tmp_path: Path,
) -> None:
    reference = references.get(chaos_stack)
    before = chaoslib.baseline(chaos_stack, contract_id)
    job = chaoslib.start_job(chaos_stack, tmp_path, "during-migration", spares=2)
    try:
        chaoslib.wait_mid_run(chaos_stack, job)
        chaoslib.kill_rank(chaos_stack, job.job_id, 1)
        chaoslib.wait_incident(chaos_stack, job.job_id)  # the first migration is under way
        chaoslib.kill_rank(chaos_stack, job.job_id, 3)
        chaoslib.wait_job_ok(job)
    finally:
        job.stop()
    chaoslib.check_invariants(
        chaos_stack,
        contract_id,
        before,
        job,
        [chaoslib.Expect(rank=1), chaoslib.Expect(rank=3)],
        rec,
        reference=reference,
    )


@pytest.mark.chaos_extended
def test_spare_dies_while_joining(
    chaos_stack: Stack,
    contract_id: str,
    references: References,
    rec: chaoslib.Recorder,
    tmp_path: Path,
) -> None:
    reference = references.get(chaos_stack)
    before = chaoslib.baseline(chaos_stack, contract_id)
    job = chaoslib.start_job(chaos_stack, tmp_path, "spare-dies", spares=2)
    try:
        chaoslib.wait_mid_run(chaos_stack, job)
        spares = [
            chaoslib.launcher_pid(chaos_stack, job.job_id, f"{job.job_id}-s{j}") for j in (0, 1)
        ]
        chaoslib.kill_rank(chaos_stack, job.job_id, 1)
        # Whichever spare the executor picks, the first one dies as the rank moves to it.
        chosen = spares[0]
        os.kill(int(chosen["pid"]), signal.SIGKILL)
        rec.ok("spare killed while joining")
        chaoslib.wait_job_ok(job)
    finally:
        job.stop()
    # The rank's failure is one incident resolved by migration; if the dead spare had already
    # been named in a generation, its loss is a second incident, also migrated.
    chaoslib.check_invariants(
        chaos_stack,
        contract_id,
        before,
        job,
        [chaoslib.Expect(rank=1)],
        rec,
        reference=reference,
        extra_ok=1,
    )
