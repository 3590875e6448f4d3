"""Scenario 9: two replicas of every service (``torchrelay up --replicas 2``).

With a migration in flight (a rank SIGKILLed just before):

- SIGKILL of one replica of each service in turn (the leader, for the services that elect
  one): the other replica carries on (a standby takes the lease), the job ends bitwise equal
  to the fault-free run, every incident is recorded once.
- SIGSTOP of a replica for 20 s, then SIGCONT: a leader that wakes finds its lease lapsed and
  exits without acting on what it read before the pause (the supervisor restarts it as a
  standby); the job and the ledger are as above.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.chaos import chaoslib
from tests.chaos.conftest import References
from tests.harness import Stack, start_stack, stop_stack, wait_until
from torchrelay.service import ELECTED_SERVICES

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]

SERVICES = ("migration_executor", "scheduler", "billing", "detector", "spare_pool", "api")
PAUSE_S = 20.0


@pytest.fixture(scope="module")
def chaos_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Its own stack, with two processes of every service."""
    env = dict(chaoslib.STACK_ENV, TORCHRELAY_SERVICE_REPLICAS="2")
    s = start_stack(tmp_path_factory.mktemp("chaos-replicas"), env)
    try:
        yield s
    finally:
        stop_stack(s)


def _role(port: int) -> str | None:
    try:
        body = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2.0).json()
    except (httpx.HTTPError, ValueError):
        return None
    detail = body.get("detail") or {}
    return str(detail.get("role", "shared")) if body.get("ready") else None


def replicas(stack: Stack, name: str) -> list[tuple[int, int, str | None]]:
    """(pid, port, role) of every process of ``name``: role is leader/standby/shared, or
    None while it is not ready."""
    stack.reload()
    procs = stack.info["services"][name]["replicas"]
    return [(int(p["pid"]), int(p["port"]), _role(int(p["port"]))) for p in procs]


def leader(stack: Stack, name: str, timeout: float = 30) -> int:
    """The pid of the replica that leads ``name`` (the first, for a service that shares):
    waits until exactly one leads."""

    def one() -> int | None:
        procs = replicas(stack, name)
        if name not in ELECTED_SERVICES:
            return procs[0][0] if procs[0][2] == "shared" else None
        leading = [pid for pid, _, role in procs if role == "leader"]
        return leading[0] if len(leading) == 1 else None

    return int(wait_until(one, timeout, f"one leader of {name}", 0.2))


@contextlib.contextmanager
def migration_in_flight(
    stack: Stack,
    contract_id: str,
    references: References,
    rec: chaoslib.Recorder,
    job_id: str,
    tmp_path: Path,
) -> Iterator[chaoslib.Job]:
    """A chaos job with rank 1 just SIGKILLed (its migration in flight) for the body's fault;
    then the job must finish, every replica be back and the suite's invariants hold."""
    reference = references.get(stack)
    before = chaoslib.baseline(stack, contract_id)
    job = chaoslib.start_job(stack, tmp_path, job_id, spares=1)
    try:
        chaoslib.wait_mid_run(stack, job)
        chaoslib.kill_rank(stack, job.job_id, 1)
        yield job
        chaoslib.wait_job_ok(job)
    finally:
        job.stop()
    for service in SERVICES:
        _both_ready(stack, service)
    chaoslib.check_invariants(
        stack, contract_id, before, job, [chaoslib.Expect(rank=1)], rec, reference=reference
    )


def _standby_takes_over(
    stack: Stack, service: str, old: int, timeout: float, rec: chaoslib.Recorder
) -> None:
    if service in ELECTED_SERVICES:
        # The other replica takes the lease once it lapses (a TTL of 2 s).
        assert leader(stack, service, timeout=timeout) != old
        rec.ok(f"a standby of {service} took the lease from pid {old}")


@pytest.mark.parametrize(
    "service",
    [
        "migration_executor",
        *(pytest.param(s, marks=pytest.mark.chaos_extended) for s in SERVICES[1:]),
    ],
)
def test_kill_one_replica_during_migration(
    service: str,
    chaos_stack: Stack,
    contract_id: str,
    references: References,
    rec: chaoslib.Recorder,
    tmp_path: Path,
) -> None:
    first = leader(chaos_stack, service)
    job_id = f"replica-kill-{service.replace('_', '-')}"
    with migration_in_flight(chaos_stack, contract_id, references, rec, job_id, tmp_path):
        os.kill(first, signal.SIGKILL)
        chaoslib.trace(f"SIGKILL to {service}'s leading replica (pid {first})")
        _standby_takes_over(chaos_stack, service, first, 20, rec)
    # The supervisor brought the killed replica back; one replica leads, the other stands by.
    roles = sorted(str(role) for _, _, role in replicas(chaos_stack, service))
    expected = ["leader", "standby"] if service in ELECTED_SERVICES else ["shared", "shared"]
    assert roles == expected, roles
    rec.ok(f"{service}: {' + '.join(roles)} after the restart")


@pytest.mark.parametrize(
    "service",
    [
        "scheduler",
        *(pytest.param(s, marks=pytest.mark.chaos_extended) for s in SERVICES if s != "scheduler"),
    ],
)
def test_pause_a_replica_for_20s_during_migration(
    service: str,
    chaos_stack: Stack,
    contract_id: str,
    references: References,
    rec: chaoslib.Recorder,
    tmp_path: Path,
) -> None:
    paused = leader(chaos_stack, service)
    job_id = f"replica-pause-{service.replace('_', '-')}"
    with migration_in_flight(chaos_stack, contract_id, references, rec, job_id, tmp_path):
        os.kill(paused, signal.SIGSTOP)
        stopped_at = time.monotonic()
        chaoslib.trace(f"SIGSTOP to {service}'s leading replica (pid {paused})")
        try:
            _standby_takes_over(chaos_stack, service, paused, 15, rec)
            time.sleep(max(0.0, PAUSE_S - (time.monotonic() - stopped_at)))
        finally:
            os.kill(paused, signal.SIGCONT)
            chaoslib.trace(f"SIGCONT to {service} (pid {paused})")
        if service in ELECTED_SERVICES:
            # It wakes past its lease's local deadline: it exits before acting on anything.
            wait_until(
                lambda: not chaoslib.pid_alive(paused), 15, f"the paused {service} exits", 0.2
            )
            log = _log_of(chaos_stack, service)
            assert "lost the leader lease" in log, log[-2000:]
            rec.ok(f"the woken {service} exited on its lapsed lease")
    if service in ELECTED_SERVICES:
        assert leader(chaos_stack, service) != paused
        rec.ok(f"one leader of {service} after the pause")


def _both_ready(stack: Stack, service: str) -> None:
    """Wait until the supervisor has every replica of ``service`` back and ready."""
    wait_until(
        lambda: all(role is not None for _, _, role in replicas(stack, service)),
        90,
        f"both replicas of {service} ready again",
        0.5,
    )


def _log_of(stack: Stack, service: str) -> str:
    logs = sorted((stack.state_dir / "logs").glob(f"{service}*.log"))
    return "\n".join(p.read_text(errors="replace") for p in logs)
