"""Scenario 2: the servers themselves fail.

- kill -9 of ``redis-server`` during a run: the supervisor restarts it on its AOF, nothing
  recorded before is lost and a failure after the restart is still handled and recorded.
- A restart of ``nats-server`` (JetStream file store) during a migration: the migration
  completes, nothing is recorded twice.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos import chaoslib
from tests.chaos.conftest import References
from tests.harness import Stack, start_stack, stop_stack, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def chaos_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Its own stack: these scenarios kill the servers the others rely on."""
    s = start_stack(tmp_path_factory.mktemp("chaos-servers"), chaoslib.STACK_ENV)
    try:
        yield s
    finally:
        stop_stack(s)


def test_kill_redis_during_run(
    chaos_stack: Stack,
    contract_id: str,
    references: References,
    rec: chaoslib.Recorder,
    tmp_path: Path,
) -> None:
    reference = references.get(chaos_stack)
    before = chaoslib.baseline(chaos_stack, contract_id)
    job = chaoslib.start_job(chaos_stack, tmp_path, "kill-redis", spares=1)
    try:
        chaoslib.wait_mid_run(chaos_stack, job)
        old = chaoslib.signal_service(chaos_stack, "redis", signal.SIGKILL)
        chaoslib.wait_restarted(chaos_stack, "redis", old)
        rec.ok("redis restarted by the supervisor")
        # What the control plane knew before the crash is still there (the job's record).
        wait_until(
            lambda: chaoslib.job_step(chaos_stack, job.job_id) >= 0,
            90,
            "the job's record read back after the redis restart",
            interval=0.5,
        )
        rec.ok("job record survived the redis restart")
        # And a failure after the restart is still detected, migrated and recorded.
        chaoslib.kill_rank(chaos_stack, job.job_id, 2)
        chaoslib.wait_job_ok(job)
    finally:
        job.stop()
    chaoslib.check_invariants(
        chaos_stack, contract_id, before, job, [chaoslib.Expect(rank=2)], rec, reference=reference
    )


@pytest.mark.chaos_extended
def test_restart_nats_during_migration(
    chaos_stack: Stack,
    contract_id: str,
    references: References,
    rec: chaoslib.Recorder,
    tmp_path: Path,
) -> None:
    reference = references.get(chaos_stack)
    before = chaoslib.baseline(chaos_stack, contract_id)
    job = chaoslib.start_job(chaos_stack, tmp_path, "restart-nats", spares=1)
    try:
        chaoslib.wait_mid_run(chaos_stack, job)
        chaoslib.kill_rank(chaos_stack, job.job_id, 1)
        chaoslib.wait_incident(chaos_stack, job.job_id)
        old = chaoslib.signal_service(chaos_stack, "nats", signal.SIGTERM)
        chaoslib.wait_restarted(chaos_stack, "nats", old)
        rec.ok("nats restarted by the supervisor")
        chaoslib.wait_job_ok(job)
    finally:
        job.stop()
    chaoslib.check_invariants(
        chaos_stack, contract_id, before, job, [chaoslib.Expect(rank=1)], rec, reference=reference
    )
