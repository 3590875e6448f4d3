"""No spare left: ``checkpoint_restart`` restarts the job from its DCP checkpoint.

A 3-rank job with no spare loses rank 1 in step 37's all-reduce; checkpoints are taken every
10 steps, so the launcher restarts every process from the checkpoint of step 30 and the job
finishes on its own. The final state must be bitwise equal to the fault-free run's (the
step-indexed data and per-step seeds make the replay of steps 30-36 exact), and the incident
records the fallback with its 7 lost steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Stack, digests, run_job, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 45
KILL_STEP = 37
# The second fault point runs with `make e2e` (TORCHRELAY_E2E=all): make test's budget.
FULL_ONLY = pytest.mark.skipif(
    os.environ.get("TORCHRELAY_E2E") != "all", reason="make e2e runs it (TORCHRELAY_E2E=all)"
)


def _alone(job_id: str) -> dict[str, str]:
    """A cluster of the job's own: no idle slot another test's node agents left in the
    spare pool can become its spare (the fallback is what these tests are about)."""
    return {"TORCHRELAY_CLUSTER": f"c-{job_id}"}


def _incidents(stack: Stack, job_id: str) -> list[dict[str, Any]]:
    with stack.api() as api:
        resp = api.get("/v1/incidents", params={"job_id": job_id, "limit": 100})
        resp.raise_for_status()
        return list(resp.json()["items"])


def _restarted(stack: Stack, job_id: str) -> dict[str, Any] | None:
    found = [i for i in _incidents(stack, job_id) if i["stall_ms"] is not None]
    return found[0] if found else None


@pytest.fixture(scope="module")
def expected(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The fault-free run's final state digests, rank by rank."""
    out = tmp_path_factory.mktemp("restart-ref")
    ref = run_job(stack, "restart-ref", nproc=3, spares=0, steps=STEPS, out=out / "out")
    assert ref.wait(300) == 0, (out / "restart-ref.log").read_text()[-3000:]
    found = digests(out / "out")
    assert sorted(found) == [0, 1, 2]
    return found


@pytest.mark.parametrize(
    ("point", "step", "kept", "lost"),
    [
        pytest.param("allreduce", KILL_STEP, 30, 7, id="kill-in-step-37"),
        # Rank 1 dies before writing its part of checkpoint 40: that checkpoint never
        # completes, the job restarts from 30 and loses the 10 steps since.
        pytest.param("checkpoint", 40, 30, 10, id="kill-in-checkpoint-write", marks=FULL_ONLY),
    ],
)
def test_checkpoint_restart_resumes_from_the_checkpoint_bitwise(
    stack: Stack,
    expected: dict[int, str],
    tmp_path: Path,
    point: str,
    step: int,
    kept: int,
    lost: int,
) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    job_id = f"restart-{point}"
    proc = run_job(
        stack,
        job_id,
        nproc=3,
        spares=0,
        steps=STEPS,
        out=out,
        policy="checkpoint_restart",
        run_args=["--checkpoint-dir", str(ckpt), "--checkpoint-every", "10"],
        env={"TORCHRELAY_CHAOS_POINT": f"{point}:{job_id}-w1:{step}", **_alone(job_id)},
    )
    rc = proc.wait(400)
    log = (tmp_path / f"{job_id}.log").read_text()
    assert rc == 0, log[-4000:]
    assert "restart 1/3" in log, log[-4000:]
    assert f"{kept} steps kept, {lost} lost" in log, log[-4000:]
    assert digests(out) == expected

    incident = wait_until(lambda: _restarted(stack, job_id), 60, "the restart's stall")
    assert incident["resolution"] == "checkpoint_restart"
    assert incident["rank"] == 1
    assert incident["lost_steps"] == lost
    assert incident["stall_ms"] > 0
    # Checkpoints kept: the two newest complete ones (30 before the fault, 40 after it).
    complete = sorted(p.name for p in ckpt.iterdir() if (p / "torchrelay.json").exists())
    assert complete == ["step-00000030", "step-00000040"]
    manifest = json.loads((ckpt / "step-00000040" / "torchrelay.json").read_text())
    assert manifest["world_size"] == 3
    assert manifest["steps"] == 40


def test_shrink_goes_on_at_the_smaller_world_size_and_says_what_changed(
    stack: Stack, tmp_path: Path
) -> None:
    job_id = "restart-shrink"
    proc = run_job(
        stack,
        job_id,
        nproc=3,
        spares=0,
        steps=30,
        out=tmp_path / "out",
        policy="shrink",
        run_args=["--allow-shrink"],
        env={"TORCHRELAY_CHAOS_POINT": f"allreduce:{job_id}-w1:12", **_alone(job_id)},
    )
    rc = proc.wait(300)
    log = (tmp_path / f"{job_id}.log").read_text()
    assert rc == 0, log[-4000:]
    assert "the job shrank from 3 to 2 ranks" in log, log[-4000:]
    assert "the global batch is 2 x 32 = 64 samples (was 96)" in log, log[-4000:]
    assert sorted(digests(tmp_path / "out")) == [0, 1]
    [incident] = wait_until(
        lambda: [i for i in _incidents(stack, job_id) if i["resolution"] != "open"],
        60,
        "the incident to close",
    )
    assert incident["resolution"] == "shrunk"
    assert incident["rank"] == 1


FSDP_SCRIPT = Path(__file__).parents[1] / "helpers" / "train_fsdp.py"
HSDP_STEPS = "16"


def _run_sharded(
    stack: Stack,
    tmp_path: Path,
    job_id: str,
    spares: int,
    run_args: list[str],
    nproc: int = 4,
    **env: str,
) -> subprocess.Popen[bytes]:
    """``torchrelay run`` of the sharded script (HSDP 2 x 2 unless ``TR_MESH`` says)."""
    cmd = [sys.executable, "-m", "torchrelay.cli", "run", "--nproc", str(nproc)]
    cmd += ["--spares", str(spares), "--job-id", job_id, "--tenant", "acme", *run_args]
    log = (tmp_path / f"{job_id}.log").open("ab")
    env = {"TR_MESH": "hsdp", "TR_STEPS": HSDP_STEPS, **env}
    return subprocess.Popen(
        [*cmd, str(FSDP_SCRIPT)], env=stack.env(**env), stdout=log, stderr=subprocess.STDOUT
    )


def _run_files(stack: Stack, job_id: str, suffix: str) -> list[dict[str, Any]]:
    run_dir = stack.state_dir / "runs" / job_id
    return [json.loads(p.read_text()) for p in sorted(run_dir.glob(f"*.{suffix}.json"))]


def _shard_digests(stack: Stack, job_id: str) -> dict[int, str]:
    return {int(d["rank"]): d["digest"] for d in _run_files(stack, job_id, "digest")}


def test_an_fsdp_job_restarts_at_2_ranks_from_its_4_rank_checkpoint_bitwise(
    stack: Stack, tmp_path: Path
) -> None:
    """Rank 1's GPU falls off the bus (XID 79) before step 37's forward and no spare is
    left. The launcher leaves that slot out and, allowed to shrink, restarts at the largest
    world size dividing 4 that the 3 fit slots hold, 2, from the 4-rank FSDP2 checkpoint
    of step 30 (DCP reshards it). Its reference makes the same change without a fault: 4
    ranks checkpointing for 31 steps, then a 2-rank job resuming from that directory."""
    sharded = {"TR_MESH": "fsdp", "TR_FULL_AT": "end"}
    every = ["--checkpoint-every", "10"]
    ref_dir = ["--checkpoint-dir", str(tmp_path / "ref-ckpt"), *every]
    ref4 = _run_sharded(stack, tmp_path, "fsdp-ref4", 0, ref_dir, TR_STEPS="31", **sharded)
    assert ref4.wait(300) == 0, (tmp_path / "fsdp-ref4.log").read_text()[-3000:]
    ref2 = _run_sharded(
        stack, tmp_path, "fsdp-ref2", 0, ref_dir, nproc=2, TR_STEPS=str(STEPS), **sharded
    )
    assert ref2.wait(300) == 0, (tmp_path / "fsdp-ref2.log").read_text()[-3000:]
    expected = {d["full"] for d in _run_files(stack, "fsdp-ref2", "digest")}
    assert len(expected) == 1
    assert None not in expected

    job_id = "fsdp-xid"
    args = ["--policy", "checkpoint_restart", "--allow-shrink"]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt"), *every]
    proc = _run_sharded(
        stack,
        tmp_path,
        job_id,
        0,
        args,
        TR_STEPS=str(STEPS),
        TR_HANG_AT=f"{KILL_STEP}:1",
        **sharded,
        **_alone(job_id),
    )
    [hung] = wait_until(lambda: _run_files(stack, job_id, "hung"), 300, "rank 1 to hang")
    where = ["--node", hung["node"], "--gpu", str(hung["gpu"]), "--code", "79"]
    fault = subprocess.run(
        [sys.executable, "-m", "torchrelay.cli", "chaos", "xid", *where],
        env=stack.env(**_alone(job_id)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fault.returncode == 0, fault.stderr
    rc = proc.wait(400)
    log = (tmp_path / f"{job_id}.log").read_text()
    assert rc == 0, log[-4000:]
    assert f"restart 1/3 of job {job_id} at 2 ranks (was 4)" in log, log[-4000:]
    assert "30 steps kept, 7 lost" in log, log[-4000:]
    assert "the job restarted at 2 ranks from a checkpoint of 4" in log, log[-4000:]
    final = _run_files(stack, job_id, "digest")
    assert sorted(d["rank"] for d in final) == [0, 1]
    with stack.api() as api:
        ranks = api.get(f"/v1/jobs/{job_id}").raise_for_status().json()["ranks"]
    assert len(ranks) == 2
    assert (hung["node"], hung["gpu"]) not in {(r["node"], r["gpu"]) for r in ranks}
    assert {d["full"] for d in final} == expected
    incident = wait_until(lambda: _restarted(stack, job_id), 60, "the restart's stall")
    assert incident["resolution"] == "checkpoint_restart"
    assert incident["fault_kind"] == "gpu_lost"
    assert incident["rank"] == 1
    assert incident["lost_steps"] == 7


@FULL_ONLY  # make test covers the fallback in test_sharded.py (no checkpoint there)
def test_an_hsdp_pair_lost_whole_goes_to_the_restart_and_ends_bitwise(
    stack: Stack, tmp_path: Path
) -> None:
    """Ranks 1 and 3 hold HSDP's shard 1: both killed at once, no copy of it survives. The
    spares cannot be given it, so the migration fails over to checkpoint_restart and the
    job resumes from its checkpoint of step 10, bitwise equal to the fault-free run."""
    ref = _run_sharded(stack, tmp_path, "hsdp-ref", 0, [])
    assert ref.wait(300) == 0, (tmp_path / "hsdp-ref.log").read_text()[-3000:]
    expected = _shard_digests(stack, "hsdp-ref")
    assert sorted(expected) == [0, 1, 2, 3]

    job_id = "hsdp-pair"
    args = ["--policy", "checkpoint_restart", "--checkpoint-dir", str(tmp_path / "ckpt")]
    proc = _run_sharded(
        stack,
        tmp_path,
        job_id,
        2,
        [*args, "--checkpoint-every", "5"],
        TR_KILL_AT="backward:12:1+3",
        **_alone(job_id),
    )
    rc = proc.wait(400)
    log = (tmp_path / f"{job_id}.log").read_text()
    assert rc == 0, log[-4000:]
    assert "cannot restore rank(s) [1, 3] live" in log, log[-4000:]
    assert "10 steps kept, 2 lost" in log, log[-4000:]
    assert _shard_digests(stack, job_id) == expected
    closed = wait_until(
        lambda: [i for i in _incidents(stack, job_id) if i["resolution"] != "open"],
        60,
        "the incidents to close",
    )
    assert {i["resolution"] for i in closed} == {"checkpoint_restart"}
