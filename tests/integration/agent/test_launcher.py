"""``torchrelay run`` and ``torchrelay chaos`` on a real job: pid look-up, exit reports,
node faults without a node agent, and SIGTERM forwarded to the whole job."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.integration.agent.conftest import JobRunner
from torchrelay.contract import ReportKind

# Generous deadlines: these jobs share two cores with whatever else runs.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


async def chaos(runner: JobRunner, *argv: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "torchrelay.cli",
        "chaos",
        *argv,
        env={**os.environ, "NATS_URL": runner.nats_url},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_chaos_kills_the_rank_holder_and_sigterm_stops_the_job(
    runner: JobRunner, tmp_path: Path
) -> None:
    timeline = tmp_path / "timeline"
    timeline.mkdir()
    job, ex = await runner.start(
        "chaos",
        nproc=2,
        spares=1,
        auto_replace=False,
        env={
            "TR_STEPS": "100000",
            "TR_STEP_SLEEP_S": "0.02",
            "TORCHRELAY_AGENT_TIMELINE": str(timeline),
        },
    )
    await ex.wait_for("training", lambda: ex.step_of(f"{job.job_id}-w1") >= 2)
    pids = json.loads((job.run_dir / "launcher.json").read_text())["members"]

    code, out, err = await chaos(runner, "kill", "--job", job.job_id, "--rank", "1")
    assert code == 0, err
    killed = json.loads(out)
    assert killed["member_id"] == f"{job.job_id}-w1"
    assert killed["pid"] == pids[f"{job.job_id}-w1"]
    exits = await ex.wait_for("the launcher's exit report", lambda: ex.of(ReportKind.WORKER_EXIT))
    assert exits[0].member_id == f"{job.job_id}-w1"
    assert exits[0].rank == 1
    assert exits[0].exit_code == -signal.SIGKILL
    assert (exits[0].error or "").startswith("lost")
    # Reported from the rank's death latch while it was dying, not only once reaped.
    marks = [
        json.loads(line)
        for line in (timeline / f"launcher-{job.job_id}.timeline").read_text().splitlines()
    ]
    dying = [m for m in marks if m["event"] == "dying"]
    assert [(m["member"], m["code"]) for m in dying] == [(f"{job.job_id}-w1", -signal.SIGKILL)]

    code, _, err = await chaos(runner, "xid", "--node", "local-0", "--gpu", "0", "--code", "79")
    assert code == 1
    assert "no detector node agent answers for local/local-0" in err

    job.proc.send_signal(signal.SIGTERM)
    assert await job.wait(60) == 128 + signal.SIGTERM
    assert "cancelled" in job.output()
    assert all(gone(pid) for pid in pids.values())
