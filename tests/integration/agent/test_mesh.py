"""FSDP2, HSDP and tensor parallelism over torchrelay's process groups, rebound to a new
transport mid-run, train bit for bit as over torch's own gloo groups."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("mesh_script.py")
WORLD = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(mode: str) -> dict[tuple[str, int], str]:
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "MESH_PORT": str(port),
            "MESH_MODE": mode,
            "TORCH_GLOO_LAZY_INIT": "1",
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    digests: dict[tuple[str, int], str] = {}
    for proc in procs:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{mode}: {out[-3000:]}"
        for name, rank, value in re.findall(r"^digest (\w+) (\d+) (\w+)$", out, re.M):
            digests[(name, int(rank))] = value
    return digests


def test_sharded_training_over_rebound_groups_equals_stock_groups() -> None:
    stock = _run("stock")
    relay = _run("relay")
    assert len(stock) == 3 * WORLD
    assert relay == stock
    # The shapes shard as they should: every FSDP rank holds its own shard, HSDP's two
    # replicas of a shard (ranks r and r+2) hold the same bits, as do TP's data-parallel
    # peers; the shards of one replica differ.
    assert len({stock[("fsdp", r)] for r in range(WORLD)}) == WORLD
    for name in ("hsdp", "tp"):
        assert stock[(name, 0)] == stock[(name, 2)]
        assert stock[(name, 1)] == stock[(name, 3)]
        assert stock[(name, 0)] != stock[(name, 1)]


@pytest.mark.parametrize(
    ("fault", "expected"), [("kill", "CollectiveError"), ("stop", "Abandoned")]
)
def test_a_lost_peer_poisons_the_generation_without_raising_into_the_loop(
    fault: str, expected: str, tmp_path: Path
) -> None:
    """Killed, the peer's socket closes and the collective fails; stopped, it hangs until a
    newer generation (here: the stale file) means leaving it. Either way the survivor's
    forward, backward, clipping and optimizer step run to the end of the step."""
    port, stale = _free_port(), tmp_path / "stale"
    env = {
        **os.environ,
        "MESH_PORT": str(port),
        "POISON_FAULT": fault,
        "POISON_STALE_FILE": str(stale),
        "TORCH_GLOO_LAZY_INIT": "1",
        "OMP_NUM_THREADS": "1",
    }
    script = str(SCRIPT.with_name("poison_script.py"))
    procs = [
        subprocess.Popen(
            [sys.executable, script],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        assert procs[0].stdout is not None
        lines = []
        for line in procs[0].stdout:
            lines.append(line)
            if line.startswith("ready") and fault == "stop":
                stale.touch()  # the newer generation a stopped peer never joins
        out = "".join(lines)
        assert procs[0].wait(timeout=60) == 0, out[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert "step 0 poisoned NoneType" in out
    assert f"step 1 poisoned {expected}" in out
    assert "probe [0.0, 0.0, 0.0]" in out
