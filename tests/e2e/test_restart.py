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
        env={"TORCHRELAY_CHAOS_POINT": f"{point}:{job_id}-w1:{step}"},
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
