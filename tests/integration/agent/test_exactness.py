"""Exactness at the job's start and along the way: DDP's start and the divergence guard.

Real ``torchrelay run`` jobs of the test script (tests/helpers/train_mlp.py) with the test
executor; every test job runs the guard at every step (``TORCHRELAY_VERIFY_EVERY=1``).
"""

from __future__ import annotations

import pytest

from tests.helpers.relay import LaunchedJob
from tests.integration.agent.conftest import JobRunner
from tests.integration.agent.test_migration import ENV, finish, reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


async def failed_output(job: LaunchedJob) -> str:
    """The output of a job that must fail."""
    assert await job.wait() != 0, job.output()[-4000:]
    return job.output()


async def test_ranks_seeded_apart_start_from_rank_0s_state(runner: JobRunner) -> None:
    # Each rank builds its model from its own seed; rank 0's is the reference run's seed.
    # Like DDP's construction, the first generation starts every rank from rank 0's state.
    ref = await reference(runner)
    job, _ = await runner.start("seeded-apart", nproc=3, env={**ENV, "TR_SEED_BY_MEMBER": "1"})
    await finish(job, ref)


async def test_a_rank_that_tracks_another_shape_stops_the_job_naming_it(
    runner: JobRunner,
) -> None:
    job, _ = await runner.start("other-shape", nproc=3, env={**ENV, "TR_WIDTH_OF": "{job}-w2:48"})
    out = await failed_output(job)
    assert "rank 2 tracks a state that does not match rank 0's: model.0.bias is " in out, out[
        -4000:
    ]
    assert "torch.float32[48] on rank 2 but torch.float32[32] on rank 0" in out


async def test_the_divergence_guard_stops_the_job_at_the_step_naming_rank_and_tensor(
    runner: JobRunner,
) -> None:
    # w1 nudges its first weight after committing step 4, behind the agent's back.
    job, _ = await runner.start("drift", nproc=3, env={**ENV, "TR_PERTURB": "{job}-w1:4"})
    out = await failed_output(job)
    assert (
        "after step 5 in generation 1 rank 1's tracked state differs from rank 0's, "
        "first in model.0.weight (ranks that differ: [1])"
    ) in out, out[-4000:]
