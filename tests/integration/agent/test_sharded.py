"""Sharded jobs under ``torchrelay run``: FSDP2, HSDP and tensor parallelism over
``job.device_mesh``, each compared bitwise with its fault-free run.

A lost rank whose shard another rank holds (HSDP's other replica, a TP shard's data-parallel
peer) or keeps a copy of (pure FSDP's buddy) is restored live on a spare. One whose shard no
survivor holds (a whole replica pair of HSDP) stops the job saying so: never another rank's
shard.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.matrix import cpu_load
from tests.integration.agent.conftest import JobRunner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).parents[2] / "helpers" / "train_fsdp.py"
STEPS = "10"

_reference: dict[str, dict[int, str]] = {}


async def reference(runner: JobRunner, mesh: str) -> dict[int, str]:
    """The digests of the fault-free 4-rank run of ``mesh`` (once per session)."""
    if mesh not in _reference:
        job, _ = await runner.start(
            f"ref-{mesh}", nproc=4, env={"TR_MESH": mesh, "TR_STEPS": STEPS}, script=SCRIPT
        )
        assert await job.wait() == 0, job.output()[-4000:]
        _reference[mesh] = job.digests()
        assert sorted(_reference[mesh]) == [0, 1, 2, 3], job.output()[-3000:]
    return _reference[mesh]


async def kill_at(runner: JobRunner, mesh: str, victims: list[int], spares: int) -> tuple[int, Any]:
    """Start a 4-rank ``mesh`` job, SIGKILL ``victims`` once they reached step 3.

    The divergence guard runs every 2 steps: after the restore it compares each rank with
    the first rank holding the same shard.
    """
    env = {"TR_MESH": mesh, "TR_STEPS": STEPS, "TORCHRELAY_VERIFY_EVERY": "2"}
    job, ex = await runner.start(f"{mesh}-kill", nproc=4, spares=spares, env=env, script=SCRIPT)
    names = [f"{job.job_id}-w{v}" for v in victims]
    for name in names:
        await ex.wait_for(f"{name} at step 3", lambda name=name: ex.step_of(name) >= 3)
    for name in names:
        os.kill(job.pid_of(name), signal.SIGKILL)
    code = await asyncio.wait_for(job.wait(), 180)
    return code, job


async def test_an_hsdp_job_keeps_replicas_equal_and_shards_apart(runner: JobRunner) -> None:
    digests = await reference(runner, "hsdp")
    # Mesh (replicate, shard): ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1. The
    # replicas stay equal through FSDP2's all-reduce, and the agent did not make every rank
    # rank 0's (DDP's start does not apply to shards).
    assert digests[0] == digests[2]
    assert digests[1] == digests[3]
    assert digests[0] != digests[1]


# Where in a step rank 1 dies: points the script reaches (TR_KILL_AT) and the agent's own
# (TORCHRELAY_CHAOS_POINT). "clip" and "optimizer" leave the survivors running the optimizer
# step's collectives against a dead peer; "after", "commit" kill between the optimizer step
# and the commit; the restore's own send and receive are killed in test_shard_chaos.
SCRIPT_POINTS = ("forward", "backward", "clip", "optimizer", "after")
AGENT_POINTS = ("optimizer", "commit")
FULL = [
    *(
        (mesh, "script", p, load)
        for mesh in ("hsdp", "tp", "fsdp")
        for p in SCRIPT_POINTS
        for load in ("idle", "hogs")
    ),
    *((mesh, "agent", p, "idle") for mesh in ("hsdp", "tp", "fsdp") for p in AGENT_POINTS),
    # The spare killed while it receives the shard: a second spare gets it from rank 3.
    ("hsdp", "agent", "recv_state", "idle"),
]
REDUCED = [
    ("hsdp", "script", "clip", "hogs"),
    ("hsdp", "agent", "recv_state", "idle"),
    ("fsdp", "agent", "commit", "idle"),
]
CELLS = FULL if os.environ.get("TORCHRELAY_CHAOS") == "all" else REDUCED


@pytest.mark.parametrize(("mesh", "where", "point", "load"), CELLS)
async def test_a_rank_killed_at_any_point_of_a_step_gets_its_shard_back(
    runner: JobRunner, mesh: str, where: str, point: str, load: str
) -> None:
    ref = await reference(runner, mesh)
    env = {"TR_MESH": mesh, "TR_STEPS": STEPS, "TORCHRELAY_VERIFY_EVERY": "3"}
    spares = 1
    if where == "script":
        env["TR_KILL_AT"] = f"{point}:3:1"
    elif point == "recv_state":  # the first spare dies receiving rank 1's shard
        env["TORCHRELAY_CHAOS_POINT"] = f"{point}:{{job}}-s0:3"
        env["TR_KILL_AT"] = "clip:3:1"
        spares = 2
    else:
        env["TORCHRELAY_CHAOS_POINT"] = f"{point}:{{job}}-w1:3"
    job, _ = await runner.start(f"{mesh}-{point}", nproc=4, spares=spares, env=env, script=SCRIPT)
    with cpu_load(load):
        assert await asyncio.wait_for(job.wait(), 240) == 0, job.output()[-4000:]
    if point == "recv_state":
        assert (job.run_dir / f"{job.job_id}-s1.digest.json").exists(), job.output()[-3000:]
        assert job.digests() == ref, "final shards differ from the fault-free run"
        return
    # The fault happened and the spare took rank 1 over, with its shard.
    assert (job.run_dir / f"{job.job_id}-s0.digest.json").exists(), job.output()[-3000:]
    assert job.digests() == ref, "final shards differ from the fault-free run"


@pytest.mark.parametrize(
    "mesh", ["hsdp", "tp"] if os.environ.get("TORCHRELAY_CHAOS") == "all" else ["tp"]
)
async def test_a_killed_rank_gets_its_shard_from_its_replica(runner: JobRunner, mesh: str) -> None:
    ref = await reference(runner, mesh)
    code, job = await kill_at(runner, mesh, [1], spares=1)
    assert code == 0, job.output()[-4000:]
    assert (job.run_dir / f"{job.job_id}-s0.digest.json").exists(), job.output()[-3000:]
    assert job.digests() == ref, "final shards differ from the fault-free run"


def _errors(job: Any) -> dict[str, str]:
    return {
        path.name: json.loads(path.read_text()).get("error", "")
        for path in job.run_dir.glob("*.exit.json")
    }


@pytest.mark.parametrize(
    ("mesh", "victims"),
    [
        ("hsdp", [1, 3]),  # both holders of HSDP's shard 1
        ("fsdp", [1, 2]),  # a pure-FSDP rank and its buddy, which holds its only copy
    ],
)
async def test_losing_a_shard_and_every_copy_of_it_goes_to_the_fallback(
    runner: JobRunner, mesh: str, victims: list[int]
) -> None:
    """The ranks report the state lost; the migration fails over to checkpoint_restart,
    which a job without a checkpoint directory cannot take: it ends saying why."""
    code, job = await kill_at(runner, mesh, victims, spares=2)
    out = job.output()
    assert code != 0, out[-4000:]
    lost = victims if mesh == "hsdp" else victims[:1]  # FSDP: rank 2's copy is with rank 3
    assert f"cannot restore rank(s) {lost} live" in out, out[-4000:]
    # The launcher heard the migration fail over (the reason is the ranks' report).
    assert "falls back to checkpoint_restart, but the job has no --checkpoint-dir" in out
    assert not job.digests(), "no rank may finish on a state it cannot have"


async def test_a_killed_fsdp_rank_gets_its_shard_from_its_buddys_copy(
    runner: JobRunner,
) -> None:
    ref = await reference(runner, "fsdp")
    code, job = await kill_at(runner, "fsdp", [1], spares=1)
    assert code == 0, job.output()[-4000:]
    assert (job.run_dir / f"{job.job_id}-s0.digest.json").exists(), job.output()[-3000:]
    assert job.digests() == ref, "final shards differ from the fault-free run"


async def test_two_fsdp_ranks_killed_one_after_the_other(runner: JobRunner) -> None:
    # Rank 1 at step 3, then rank 2 (the buddy of the restored rank 1) at step 6: the copy
    # rank 2 holds came from the spare that took rank 1 over.
    ref = await reference(runner, "fsdp")
    env = {"TR_MESH": "fsdp", "TR_STEPS": STEPS, "TORCHRELAY_VERIFY_EVERY": "2"}
    job, ex = await runner.start("fsdp-twice", nproc=4, spares=2, env=env, script=SCRIPT)
    for victim, at in ((1, 3), (2, 6)):
        name = f"{job.job_id}-w{victim}"
        await ex.wait_for(f"{name} at step {at}", lambda n=name, a=at: ex.step_of(n) >= a)
        os.kill(job.pid_of(name), signal.SIGKILL)
    assert await asyncio.wait_for(job.wait(), 180) == 0, job.output()[-4000:]
    for spare in ("s0", "s1"):
        assert (job.run_dir / f"{job.job_id}-{spare}.digest.json").exists(), job.output()[-3000:]
    assert job.digests() == ref, "final shards differ from the fault-free run"


async def test_the_guard_compares_each_rank_with_its_shards_other_holder(
    runner: JobRunner,
) -> None:
    env = {"TR_MESH": "hsdp", "TR_STEPS": STEPS, "TORCHRELAY_VERIFY_EVERY": "2"}
    job, _ = await runner.start(
        "hsdp-drift", nproc=4, env={**env, "TR_CORRUPT_RANK": "3"}, script=SCRIPT
    )
    assert await job.wait() != 0, job.output()[-3000:]
    errors = " ".join(_errors(job).values())
    # Rank 3 holds shard 1 with rank 1: it is compared with rank 1, not with rank 0.
    assert "rank 3's tracked state differs from rank 1's, which holds the same shard" in (errors), (
        errors[-3000:]
    )
    assert "model." in errors
