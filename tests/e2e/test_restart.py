"""No spare left: ``checkpoint_restart`` restarts the job from its DCP checkpoint.

A 3-rank job with no spare loses rank 1 in step 37's all-reduce; checkpoints are taken every
10 steps, so the launcher restarts every process from the checkpoint of step 30 and the job
finishes on its own. The final state must be bitwise equal to the fault-free run's (the
step-indexed data and per-step seeds make the replay of steps 30-36 exact), and the incident
records the fallback with its 7 lost steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Stack, digests, run_job, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 45
KILL_STEP = 37


def _incidents(stack: Stack, job_id: str) -> list[dict[str, Any]]:
    with stack.api() as api:
        resp = api.get("/v1/incidents", params={"job_id": job_id, "limit": 100})
        resp.raise_for_status()
        return list(resp.json()["items"])


def _restarted(stack: Stack, job_id: str) -> dict[str, Any] | None:
    found = [i for i in _incidents(stack, job_id) if i["stall_ms"] is not None]
    return found[0] if found else None


def test_checkpoint_restart_resumes_from_the_checkpoint_bitwise(
    stack: Stack, tmp_path: Path
) -> None:
    ref_out = tmp_path / "ref"
    ref = run_job(stack, "restart-ref", nproc=3, spares=0, steps=STEPS, out=ref_out)
    assert ref.wait(300) == 0, (tmp_path / "restart-ref.log").read_text()[-3000:]
    expected = digests(ref_out)
    assert sorted(expected) == [0, 1, 2]

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    job_id = "restart-ckpt"
    proc = run_job(
        stack,
        job_id,
        nproc=3,
        spares=0,
        steps=STEPS,
        out=out,
        policy="checkpoint_restart",
        run_args=["--checkpoint-dir", str(ckpt), "--checkpoint-every", "10"],
        env={"TORCHRELAY_CHAOS_POINT": f"allreduce:{job_id}-w1:{KILL_STEP}"},
    )
    rc = proc.wait(400)
    log = (tmp_path / f"{job_id}.log").read_text()
    assert rc == 0, log[-4000:]
    assert "restart 1/3" in log, log[-4000:]
    assert "30 steps kept, 7 lost" in log, log[-4000:]
    assert digests(out) == expected

    incident = wait_until(lambda: _restarted(stack, job_id), 60, "the restart's stall")
    assert incident["resolution"] == "checkpoint_restart"
    assert incident["rank"] == 1
    assert incident["lost_steps"] == KILL_STEP - 30
    assert incident["stall_ms"] > 0
    # Checkpoints kept: the two newest complete ones (30 before the fault, 40 after it).
    kept = sorted(p.name for p in ckpt.iterdir() if (p / "torchrelay.json").exists())
    assert kept == ["step-00000030", "step-00000040"]
    manifest = json.loads((ckpt / "step-00000040" / "torchrelay.json").read_text())
    assert manifest["world_size"] == 3
    assert manifest["steps"] == 40
