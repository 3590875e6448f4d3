"""From a fault to a resumed job: every service as its own process, a real 4-rank gloo job.

Each faulty run is compared with a fault-free reference run of the same job: every rank's
final model, optimizer and scheduler state must be bitwise equal.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Stack, digests, run_job, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 80
STEP_SLEEP = "0.05"  # keeps the job running long enough for faults to land mid-run


def job(stack: Stack, job_id: str) -> dict[str, Any] | None:
    with stack.api() as api:
        resp = api.get(f"/v1/jobs/{job_id}")
        return resp.json() if resp.status_code == 200 else None


def incidents(stack: Stack, job_id: str) -> list[dict[str, Any]]:
    with stack.api() as api:
        resp = api.get("/v1/incidents", params={"job_id": job_id, "limit": 100})
        resp.raise_for_status()
        return list(resp.json()["items"])


def step_reached(stack: Stack, job_id: str, step: int) -> bool:
    info = job(stack, job_id)
    return bool(info and (info.get("committed_step") or -1) >= step)


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchrelay.cli", *args],
        env=stack.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def closed(stack: Stack, job_id: str, count: int = 1) -> list[dict[str, Any]] | None:
    items = [i for i in incidents(stack, job_id) if i["resolution"] != "open"]
    return items if len(items) >= count else None


@pytest.fixture(scope="module")
def reference(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The fault-free run's final state digests, rank by rank."""
    out = tmp_path_factory.mktemp("reference")
    proc = run_job(
        stack,
        "e2e-reference",
        nproc=4,
        spares=0,
        steps=STEPS,
        out=out,
        extra=["--step-sleep", STEP_SLEEP],
    )
    assert proc.wait(300) == 0, (out.parent / "e2e-reference.log").read_text()[-3000:]
    ref = digests(out)
    assert sorted(ref) == [0, 1, 2, 3]
    return ref


def test_sigkill_of_a_rank_is_migrated_live_and_state_stays_bitwise_equal(
    stack: Stack, reference: dict[int, str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = run_job(
        stack,
        "e2e-kill",
        nproc=4,
        spares=1,
        nodes=2,
        steps=STEPS,
        out=out,
        extra=["--step-sleep", STEP_SLEEP],
    )
    wait_until(lambda: step_reached(stack, "e2e-kill", 15), 240, "step 15 of e2e-kill")
    killed = cli(stack, "chaos", "kill", "--job", "e2e-kill", "--rank", "1")
    assert killed.returncode == 0, killed.stderr
    assert proc.wait(300) == 0, (tmp_path / "e2e-kill.log").read_text()[-3000:]
    [incident] = wait_until(lambda: closed(stack, "e2e-kill"), 60, "the incident to close")
    assert incident["fault_kind"] == "worker_lost"
    assert incident["rank"] == 1
    assert incident["resolution"] == "migrated_live"
    assert incident["stall_ms"] is not None
    assert incident["stall_ms"] > 0
    assert incident["lost_steps"] <= 1
    assert incident["bytes_moved"] > 0
    assert incident["generation_after"] == incident["generation_before"] + 1
    assert digests(out) == reference


def test_row_remap_pending_is_migrated_proactively_with_no_lost_step(
    stack: Stack, reference: dict[int, str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = run_job(
        stack,
        "e2e-remap",
        nproc=4,
        spares=1,
        nodes=2,
        steps=STEPS,
        out=out,
        extra=["--step-sleep", STEP_SLEEP],
    )
    wait_until(lambda: step_reached(stack, "e2e-remap", 15), 240, "step 15 of e2e-remap")
    slot = next(r for r in (job(stack, "e2e-remap") or {})["ranks"] if r["rank"] == 2)
    fault = cli(
        stack, "chaos", "xid", "--node", slot["node"], "--gpu", str(slot["gpu"]), "--code", "63"
    )
    assert fault.returncode == 0, fault.stderr
    assert proc.wait(300) == 0, (tmp_path / "e2e-remap.log").read_text()[-3000:]
    [incident] = wait_until(lambda: closed(stack, "e2e-remap"), 60, "the incident to close")
    assert incident["fault_kind"] == "row_remap_pending"
    assert incident["rank"] == 2
    assert incident["resolution"] == "migrated_proactive"
    assert incident["lost_steps"] == 0
    assert digests(out) == reference


def test_drain_moves_every_rank_off_the_node_at_step_boundaries(
    stack: Stack, reference: dict[int, str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    # 3 nodes: workers on n0,n1,n2,n0 and spares on n1,n2, so draining n0 moves two ranks.
    proc = run_job(
        stack,
        "e2e-drain",
        nproc=4,
        spares=2,
        nodes=3,
        steps=STEPS,
        out=out,
        extra=["--step-sleep", STEP_SLEEP],
    )
    wait_until(lambda: step_reached(stack, "e2e-drain", 15), 240, "step 15 of e2e-drain")
    node = "local-0"
    on_node = sorted(
        r["rank"] for r in (job(stack, "e2e-drain") or {})["ranks"] if r["node"] == node
    )
    assert len(on_node) == 2
    drained = cli(stack, "drain", "--node", node)
    assert drained.returncode == 0, drained.stderr
    try:
        assert proc.wait(300) == 0, (tmp_path / "e2e-drain.log").read_text()[-3000:]
        done = wait_until(lambda: closed(stack, "e2e-drain", 2), 60, "both incidents to close")
        assert sorted(i["rank"] for i in done) == on_node
        assert {i["resolution"] for i in done} == {"migrated_proactive"}
        assert all(i["lost_steps"] == 0 for i in done)
        final = job(stack, "e2e-drain") or {}
        assert all(r["node"] != node for r in final["ranks"])
        assert digests(out) == reference
    finally:
        with stack.api() as api:
            api.post(f"/v1/nodes/{node}/return")


def test_no_spare_with_checkpoint_restart_policy_records_the_fallback(
    stack: Stack, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = run_job(
        stack,
        "e2e-nospare",
        nproc=4,
        spares=0,
        steps=STEPS,
        out=out,
        policy="checkpoint_restart",
        extra=["--step-sleep", STEP_SLEEP],
    )
    wait_until(lambda: step_reached(stack, "e2e-nospare", 10), 240, "step 10 of e2e-nospare")
    assert cli(stack, "chaos", "kill", "--job", "e2e-nospare", "--rank", "2").returncode == 0
    rc = proc.wait(300)
    [incident] = wait_until(lambda: closed(stack, "e2e-nospare"), 60, "the incident to close")
    assert incident["resolution"] == "checkpoint_restart"
    assert incident["rank"] == 2
    assert rc != 0  # the launcher reports the job as not finished live
    log = (tmp_path / "e2e-nospare.log").read_text()
    assert "checkpoint_restart" in log or "checkpoint" in log


def test_wait_policy_uses_a_spare_registered_during_the_wait(
    stack: Stack, reference: dict[int, str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = run_job(
        stack,
        "e2e-wait",
        nproc=4,
        spares=0,
        steps=STEPS,
        out=out,
        policy="wait",
        extra=["--step-sleep", STEP_SLEEP],
    )
    wait_until(lambda: step_reached(stack, "e2e-wait", 10), 240, "step 10 of e2e-wait")
    assert cli(stack, "chaos", "kill", "--job", "e2e-wait", "--rank", "3").returncode == 0
    wait_until(lambda: incidents(stack, "e2e-wait"), 60, "the incident to open")
    # An operator adds a (cold) spare slot; the executor has the launcher start a process there.
    with stack.api() as api:
        resp = api.post(
            "/v1/spares",
            json={
                "slot_id": "local:local-5:0",
                "cluster": "local",
                "node": "local-5",
                "gpu": 0,
                "gpu_model": "cpu-sim",
            },
        )
        assert resp.status_code in (200, 201), resp.text
    assert proc.wait(300) == 0, (tmp_path / "e2e-wait.log").read_text()[-3000:]
    [incident] = wait_until(lambda: closed(stack, "e2e-wait"), 60, "the incident to close")
    assert incident["resolution"] == "migrated_live"
    final = job(stack, "e2e-wait") or {}
    assert any(r["node"] == "local-5" for r in final["ranks"])
    assert digests(out) == reference
