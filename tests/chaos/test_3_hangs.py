"""Scenario 3: processes that stop without dying (SIGSTOP).

- A hung worker: its heartbeats stop, the detector declares it lost, the rank migrates to the
  spare; after SIGCONT the old process does not come back into the job (it is fenced).
- A service stopped for longer than its deadlines during a migration, then continued.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.chaos import chaoslib
from tests.chaos.conftest import References
from tests.harness import Stack, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]

HUNG = frozenset({"worker_lost", "worker_hang"})


# make test covers a stopped rank in tests/integration/agent/test_migration.py and the
# conformance matrix; this end-to-end form runs with `make chaos`.
@pytest.mark.chaos_extended
def test_sigstop_worker(
    chaos_stack: Stack,
    contract_id: str,
    references: References,
    rec: chaoslib.Recorder,
    tmp_path: Path,
) -> None:
    reference = references.get(chaos_stack)
    before = chaoslib.baseline(chaos_stack, contract_id)
    job = chaoslib.start_job(chaos_stack, tmp_path, "sigstop-worker", spares=1)
    try:
        chaoslib.wait_mid_run(chaos_stack, job)
        hung = chaoslib.hang_rank(chaos_stack, job.job_id, 1)
        pid = int(hung["pid"])
        try:
            wait_until(
                lambda: (
                    (chaoslib.api_get(chaos_stack, f"/v1/jobs/{job.job_id}") or {}).get(
                        "generation", 0
                    )
                    >= 2
                ),
                120,
                "a new generation without the hung worker",
                interval=0.5,
            )
        finally:
            if chaoslib.pid_alive(pid):
                os.kill(pid, signal.SIGCONT)
        wait_until(lambda: not chaoslib.pid_alive(pid), 60, "the hung worker gone after SIGCONT")
        rec.ok("the hung worker is fenced out after SIGCONT")
        chaoslib.wait_job_ok(job)
    finally:
        job.stop()
    chaoslib.check_invariants(
        chaos_stack,
        contract_id,
        before,
        job,
        [chaoslib.Expect(rank=1, kinds=HUNG)],
        rec,
        reference=reference,
    )


@pytest.mark.chaos_extended
def test_sigstop_executor_past_deadlines(
    chaos_stack: Stack,
    contract_id: str,
    references: References,
    rec: chaoslib.Recorder,
    tmp_path: Path,
) -> None:
    reference = references.get(chaos_stack)
    before = chaoslib.baseline(chaos_stack, contract_id)
    job = chaoslib.start_job(chaos_stack, tmp_path, "sigstop-executor", spares=1)
    try:
        chaoslib.wait_mid_run(chaos_stack, job)
        chaoslib.kill_rank(chaos_stack, job.job_id, 1)
        pid = chaoslib.signal_service(chaos_stack, "migration_executor", signal.SIGSTOP)
        try:
            # The fault's duration, not a synchronisation: longer than the executor's RPC
            # timeout (3 s) and its spare reservation deadline (10 s).
            time.sleep(12)
        finally:
            os.kill(pid, signal.SIGCONT)
        rec.ok("executor continued after 12 s stopped")
        chaoslib.wait_job_ok(job)
    finally:
        job.stop()
    chaoslib.check_invariants(
        chaos_stack, contract_id, before, job, [chaoslib.Expect(rank=1)], rec, reference=reference
    )
