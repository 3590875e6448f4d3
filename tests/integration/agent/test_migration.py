"""Live migration of a rank to a hot spare, bitwise-exact, on real multi-process gloo jobs.

Each test runs ``torchrelay run`` with the test script (an MLP with dropout, AdamW and a
StepLR scheduler), injects a failure, and compares the sha256 of every rank's final tracked
state with a fault-free run of the same job. The test executor plays the control plane.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers.relay import FakeExecutor, LaunchedJob
from tests.integration.agent.conftest import JobRunner
from torchrelay.contract import EXIT_FENCED, MigrationMode, ReportKind

# Generous deadlines: these jobs share two cores with whatever else runs.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

NPROC = 3
ENV = {"TR_STEPS": "24", "TR_STEP_SLEEP_S": "0.03"}
KILL_AT = 6  # committed step after which the failure is injected

_reference: dict[tuple[int, str], dict[int, str]] = {}


async def reference(
    runner: JobRunner, nproc: int = NPROC, env: dict[str, str] = ENV
) -> dict[int, str]:
    """Digests of the fault-free run of ``nproc`` ranks with ``env`` (once per session)."""
    key = (nproc, repr(sorted(env.items())))
    if key not in _reference:
        job, _ = await runner.start("reference", nproc=nproc, env=env)
        assert await job.wait() == 0, job.output()[-3000:]
        _reference[key] = job.digests()
    return _reference[key]


async def until_step(ex: FakeExecutor, member_id: str, step: int) -> None:
    await ex.wait_for(f"{member_id} at step {step}", lambda: ex.step_of(member_id) >= step)


async def kill_one_then_another(
    job: LaunchedJob, ex: FakeExecutor, first: str, second: str
) -> None:
    """SIGKILL ``first``; once generation 2 runs, SIGKILL ``second`` three steps later."""
    await until_step(ex, first, KILL_AT)
    os.kill(job.pid_of(first), signal.SIGKILL)
    await ex.wait_for(
        "generation 2 running", lambda: len(ex.of(ReportKind.RESUMED, generation=2)) == NPROC
    )
    await until_step(ex, second, ex.step_of(second) + 3)
    os.kill(job.pid_of(second), signal.SIGKILL)


async def finish(job: LaunchedJob, ref: dict[int, str]) -> None:
    code = await job.wait()
    assert code == 0, job.output()[-4000:]
    digests = job.digests()
    assert sorted(digests) == sorted(ref), job.output()[-3000:]
    assert digests == ref, "final states differ from the fault-free run"


async def test_fault_free_ranks_agree(runner: JobRunner) -> None:
    ref = await reference(runner)
    assert sorted(ref) == list(range(NPROC))
    assert len(set(ref.values())) == 1  # data parallel: every rank holds the same state


async def test_sigkill_mid_step_hot_spare_takes_the_rank(runner: JobRunner) -> None:
    # Four ranks: rank 3 is no ring neighbour of rank 1, so its all-reduce does not fail by
    # itself; it must leave it on the new generation (and still exit cleanly at the end).
    ref = await reference(runner, 4)
    job, ex = await runner.start("kill", nproc=4, spares=1, env=ENV)
    victim = f"{job.job_id}-w1"
    await until_step(ex, victim, KILL_AT)
    os.kill(job.pid_of(victim), signal.SIGKILL)
    await finish(job, ref)

    gen2 = ex.generations[1]
    assert gen2.member_rank(f"{job.job_id}-s0") == 1
    resumed = await ex.wait_for(
        "RESUMED in generation 2",
        lambda: (
            len(ex.of(ReportKind.RESUMED, generation=2)) == 4
            and ex.of(ReportKind.RESUMED, generation=2)
        ),
    )
    assert max(r.lost_steps or 0 for r in resumed) <= 1
    # A survivor whose state the sync did not replace keeps its gradients of the step in
    # flight and only repeats the all-reduce: it recomputes nothing.
    kept = [r for r in resumed if not r.bytes_received and r.member_id != f"{job.job_id}-s0"]
    assert kept, resumed
    assert all(r.lost_steps == 0 for r in kept), resumed
    spare = next(r for r in resumed if r.member_id == f"{job.job_id}-s0")
    assert (spare.bytes_received or 0) > 0
    assert all(r.stall_ms is not None for r in resumed)


async def test_a_spare_that_warmed_up_takes_the_rank_bitwise(runner: JobRunner) -> None:
    # s0's warm-up trains on made-up data and leaves its gradients; s1's warm-up raises.
    # Both serve: the first failure goes to s0, the second to s1, and the final state is
    # still the fault-free run's. Width 160: the hidden weights and their Adam moments are
    # large enough to travel apart from the header, so they are received into the spare's
    # own tensors (s0's moments exist: its warm-up stepped the optimizer).
    wide = {**ENV, "TR_WIDTH": "160"}
    ref = await reference(runner, NPROC, wide)
    job, ex = await runner.start(
        "warm",
        nproc=NPROC,
        spares=2,
        env={**wide, "TR_WARM_UP": "{job}-s0", "TR_WARM_UP_RAISE": "{job}-s1"},
    )
    await kill_one_then_another(job, ex, f"{job.job_id}-w1", f"{job.job_id}-w2")
    await finish(job, ref)
    assert ex.generations[1].member_rank(f"{job.job_id}-s0") == 1
    assert ex.generations[2].member_rank(f"{job.job_id}-s1") == 2
    assert (job.run_dir / f"{job.job_id}-s0.warmed").exists()
    assert f"{job.job_id}-s1: warm_up raised RuntimeError: warm-up data is missing" in (
        job.output()
    )


async def test_proactive_replacement_at_a_step_boundary(runner: JobRunner) -> None:
    ref = await reference(runner)
    job, ex = await runner.start("proactive", nproc=NPROC, spares=1, env=ENV)
    leaving = f"{job.job_id}-w2"
    await until_step(ex, leaving, KILL_AT)
    await ex.replace(2, MigrationMode.BOUNDARY, reason="drain")
    await finish(job, ref)

    resumed = ex.of(ReportKind.RESUMED, generation=2)
    assert len(resumed) == NPROC
    assert all(r.lost_steps == 0 for r in resumed)  # nothing recomputed
    exits = ex.of(ReportKind.WORKER_EXIT, member_id=leaving)
    assert exits
    assert exits[0].exit_code == EXIT_FENCED


async def test_two_failures_one_after_the_other(runner: JobRunner) -> None:
    ref = await reference(runner)
    job, ex = await runner.start("twice", nproc=NPROC, spares=2, env=ENV)
    # w0 first: rank 0 also hosts the first generation's store.
    await kill_one_then_another(job, ex, f"{job.job_id}-w0", f"{job.job_id}-w2")
    await finish(job, ref)
    assert [g.generation for g in ex.generations] == [1, 2, 3]
    assert ex.generations[-1].member_rank(f"{job.job_id}-s1") == 2


async def test_spare_dying_while_joining(runner: JobRunner) -> None:
    ref = await reference(runner)
    # s0 kills itself right after a generation names it, before it has received the state.
    job, ex = await runner.start(
        "diejoin", nproc=NPROC, spares=2, env={**ENV, "TR_DIE_ON_JOIN": "{job}-s0"}
    )
    victim = f"{job.job_id}-w1"
    await until_step(ex, victim, KILL_AT)
    os.kill(job.pid_of(victim), signal.SIGKILL)
    await finish(job, ref)
    assert [g.generation for g in ex.generations] == [1, 2, 3]
    assert ex.generations[1].member_rank(f"{job.job_id}-s0") == 1
    assert ex.generations[2].member_rank(f"{job.job_id}-s1") == 1


async def test_sigstop_survivors_leave_the_stuck_collective(runner: JobRunner) -> None:
    ref = await reference(runner)
    # A long collective timeout: leaving must come from the new generation, not a timeout.
    job, ex = await runner.start(
        "stop", nproc=NPROC, spares=1, env={**ENV, "TORCHRELAY_COLLECTIVE_TIMEOUT_S": "120"}
    )
    victim = f"{job.job_id}-w1"
    await until_step(ex, victim, KILL_AT)
    pid = job.pid_of(victim)
    os.kill(pid, signal.SIGSTOP)
    try:
        written = time.monotonic()
        await ex.replace(1, MigrationMode.IMMEDIATE, reason="hang")
        await ex.wait_for(
            "survivors resumed in generation 2",
            lambda: len(ex.of(ReportKind.RESUMED, generation=2)) == NPROC,
            timeout=100,
        )
        assert time.monotonic() - written < 60  # well below the 120 s collective timeout
    finally:
        os.kill(pid, signal.SIGCONT)
    exits = await ex.wait_for(
        "the stopped worker's exit", lambda: ex.of(ReportKind.WORKER_EXIT, member_id=victim)
    )
    assert exits[0].exit_code == EXIT_FENCED
    await finish(job, ref)


async def test_application_error_is_not_migrated(runner: JobRunner) -> None:
    job, ex = await runner.start("apperr", nproc=NPROC, spares=1, env={**ENV, "TR_RAISE_AT": "1:4"})
    code = await job.wait()
    out = job.output()
    assert code != 0
    assert "application error" in out
    assert "user code failed at step 4" in out
    errors = ex.of(ReportKind.APPLICATION_ERROR)
    assert [r.member_id for r in errors] == [f"{job.job_id}-w1"]
    assert len(ex.generations) == 1  # nothing migrated
    assert (job.run_dir / f"{job.job_id}-w1.exit.json").exists()
