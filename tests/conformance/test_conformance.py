"""Every cell of the conformance matrix ends bitwise equal to its fault-free run."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conformance.matrix import (
    AGENT_POINTS,
    FAULT_STEP,
    RESULTS,
    SHAPES,
    TRANSFER_POINTS,
    Cell,
    cpu_load,
    select,
)
from tests.helpers.relay import FakeExecutor
from tests.integration.agent.conftest import JobRunner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).with_name("script.py")
NPROC = 3
BASE = {"CF_STEPS": "14", "CF_WIDTH": "64", "CF_SLEEP_S": "0.02"}
CELLS = select(os.environ.get("TORCHRELAY_CONFORMANCE", ""))
_reference: dict[str, dict[int, str]] = {}
_reference_parts: dict[str, dict[int, dict[str, str]]] = {}


def parts(run_dir: Path) -> dict[int, dict[str, str]]:
    """rank -> each tracked object's digest (what the script wrote beside the digest)."""
    out = {}
    for path in sorted(run_dir.glob("*.digest.json")):
        data = json.loads(path.read_text())
        out[int(data["rank"])] = {**data.get("parts", {}), "all": data["digest"][:12]}
    return out


async def reference(runner: JobRunner, shape: str) -> dict[int, str]:
    """The fault-free run's digests of ``shape`` (once per session, on an idle machine)."""
    if shape not in _reference:
        job, _ = await runner.start(
            f"ref-{shape}", nproc=NPROC, env={**BASE, **SHAPES[shape]}, script=SCRIPT
        )
        assert await job.wait() == 0, job.output()[-4000:]
        digests = job.digests()
        assert sorted(digests) == list(range(NPROC)), job.output()[-3000:]
        assert len(set(digests.values())) == 1, digests
        _reference[shape] = digests
        _reference_parts[shape] = parts(job.run_dir)
    return _reference[shape]


def fault_env(cell: Cell) -> dict[str, str]:
    """The environment that makes the cell's fault happen (``{job}``: the job's id)."""
    w1, w0 = "{job}-w1", "{job}-w0"
    if cell.fault == "none":
        return {}
    if cell.fault in AGENT_POINTS:
        return {"TORCHRELAY_CHAOS_POINT": f"{cell.fault}:{w1}:{FAULT_STEP}:{cell.signal}"}
    if cell.fault in TRANSFER_POINTS:
        # w1 dies between steps 3 and 4; then, in the sync that hands its rank to s0, the
        # sender w0 (send_state) or the receiver s0 (recv_state) dies mid-transfer.
        who = w0 if cell.fault == "send_state" else "{job}-s0"
        return {
            "CF_FAULT": f"between:{w1}:{FAULT_STEP - 1}:KILL",
            "TORCHRELAY_CHAOS_POINT": f"{cell.fault}:{who}:{FAULT_STEP}:KILL",
        }
    if cell.fault == "warm_up":
        # The spares warm up for 8 s; w1 dies in its forward of step 1, meanwhile.
        return {"CF_FAULT": f"forward:{w1}:1:KILL", "CF_WARM_UP_S": "8"}
    return {"CF_FAULT": f"{cell.fault}:{w1}:{FAULT_STEP}:{cell.signal}"}


def stopped(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text.rsplit(")", 1)[-1].split()[0] == "T"


async def replace_when_stopped(ex: FakeExecutor, pid_of: Callable[[str], int], member: str) -> None:
    """A SIGSTOPped rank: once it is stopped, hand its rank to a spare (the detector's part
    in production: heartbeats go on, steps do not)."""
    while True:
        try:
            if stopped(pid_of(member)):
                break
        except (OSError, KeyError, ValueError):
            pass
        await asyncio.sleep(0.05)
    gen = ex.generations[-1]
    rank = gen.member_rank(member)
    assert rank is not None
    await ex.replace(rank)


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
async def test_cell_ends_bitwise_equal_to_its_fault_free_run(runner: JobRunner, cell: Cell) -> None:
    ref = await reference(runner, cell.shape)
    row = {"shape": cell.shape, "fault": f"{cell.fault} {cell.signal}", "load": cell.load}
    # The issue-21 shape at full length is the matrix's fault-free run under load; its
    # reference runs the same 60 steps idle.
    RESULTS.append({**row, "result": "FAILED"})
    spares = 2 if cell.fault in TRANSFER_POINTS else 1
    with cpu_load(cell.load):
        name = f"cf-{cell.shape}-{cell.fault}".replace("_", "-")
        env = {**BASE, **SHAPES[cell.shape], **fault_env(cell)}
        job, ex = await runner.start(name, nproc=NPROC, spares=spares, env=env, script=SCRIPT)
        watcher = None
        if cell.signal == "STOP":
            watcher = asyncio.create_task(replace_when_stopped(ex, job.pid_of, f"{job.job_id}-w1"))
        try:
            code = await job.wait(timeout=420)
        finally:
            if watcher is not None:
                watcher.cancel()
    assert code == 0, job.output()[-4000:]
    digests = job.digests()
    assert sorted(digests) == list(range(NPROC)), job.output()[-3000:]
    assert digests == ref, (
        f"final states differ from the fault-free run: {parts(job.run_dir)} vs "
        f"{_reference_parts[cell.shape]}"
    )
    if cell.fault != "none":
        assert len(ex.generations) >= 2, "the fault did not happen"
    RESULTS[-1] = {**row, "result": f"equal ({len(ex.generations)} generations)"}
