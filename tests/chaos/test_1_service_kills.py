"""Scenario 1: kill -9 of each control-plane service in turn during a migration.

A rank is killed; right after, the service is killed with SIGKILL. The supervisor restarts
it, the migration completes, and the job ends bitwise equal to the fault-free run.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.chaos import chaoslib
from tests.chaos.conftest import References
from tests.harness import Stack

# The service that drives a migration runs in `make test` (its 20-minute budget); the rest
# with `make chaos`.
CORE = ("migration_executor",)
EXTENDED = ("scheduler", "detector", "spare_pool", "billing", "api")

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.mark.parametrize(
    "service",
    [*CORE, *(pytest.param(s, marks=pytest.mark.chaos_extended) for s in EXTENDED)],
)
def test_kill_service_during_migration(
    service: str,
    chaos_stack: Stack,
    contract_id: str,
    references: References,
    rec: chaoslib.Recorder,
    tmp_path: Path,
) -> None:
    reference = references.get(chaos_stack)
    before = chaoslib.baseline(chaos_stack, contract_id)
    job = chaoslib.start_job(chaos_stack, tmp_path, f"kill-{service.replace('_', '-')}", spares=1)
    try:
        chaoslib.wait_mid_run(chaos_stack, job)
        chaoslib.kill_rank(chaos_stack, job.job_id, 1)
        old = chaoslib.signal_service(chaos_stack, service, signal.SIGKILL)
        chaoslib.wait_restarted(chaos_stack, service, old)
        rec.ok(f"{service} restarted by the supervisor")
        chaoslib.wait_job_ok(job)
    finally:
        job.stop()
    chaoslib.check_invariants(
        chaos_stack, contract_id, before, job, [chaoslib.Expect(rank=1)], rec, reference=reference
    )
