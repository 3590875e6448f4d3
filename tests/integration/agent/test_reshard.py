"""A sharded job's checkpoint loads at another world size: a 4-rank FSDP2 job's DCP
checkpoint, loaded by a 2-rank FSDP2 job, holds bit for bit the same whole (unsharded) model
and optimizer state. What a checkpoint restart on fewer GPUs rests on (docs/design.md §13).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.agent.conftest import JobRunner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).parents[2] / "helpers" / "train_fsdp.py"


def _full(run_dir: Path) -> dict[int, str]:
    out = {}
    for path in sorted(run_dir.glob("*.digest.json")):
        data = json.loads(path.read_text())
        out[int(data["rank"])] = str(data["full"])
    return out


async def test_a_4_rank_fsdp2_checkpoint_loads_whole_at_2_ranks(
    runner: JobRunner, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    env = {
        "TR_MESH": "fsdp",
        "TORCHRELAY_CHECKPOINT_DIR": str(ckpt),
        "TORCHRELAY_CHECKPOINT_EVERY": "5",
    }
    four, _ = await runner.start(
        "reshard-4", nproc=4, env={**env, "TR_STEPS": "5", "TR_FULL_AT": "end"}, script=SCRIPT
    )
    assert await four.wait() == 0, four.output()[-4000:]
    written = _full(four.run_dir)
    assert sorted(written) == [0, 1, 2, 3]
    assert len(set(written.values())) == 1
    assert (ckpt / "step-00000005" / "torchrelay.json").exists()

    # 2 ranks resume from it: before their first step the whole state is the 4 ranks' one.
    two, _ = await runner.start(
        "reshard-2", nproc=2, env={**env, "TR_STEPS": "7", "TR_FULL_AT": "5"}, script=SCRIPT
    )
    assert await two.wait() == 0, two.output()[-4000:]
    loaded = _full(two.run_dir)
    assert sorted(loaded) == [0, 1]
    assert set(loaded.values()) == set(written.values())
    assert "resumes from" in two.output()


async def test_checkpoints_by_time_agree_across_ranks_and_change_nothing(
    runner: JobRunner, tmp_path: Path
) -> None:
    """``TORCHRELAY_CHECKPOINT_EVERY_S``: rank 0's clock decides, every rank takes the same
    step's checkpoint (else none would complete), and the run ends in the same state as
    one without checkpoints."""
    steps = {"TR_MESH": "fsdp", "TR_STEPS": "30", "TR_FULL_AT": "end", "TR_STEP_SLEEP": "0.05"}
    plain, _ = await runner.start("timed-ref", nproc=2, env=steps, script=SCRIPT)
    assert await plain.wait() == 0, plain.output()[-4000:]
    ckpt = tmp_path / "ckpt"
    timed_env = {
        **steps,
        "TORCHRELAY_CHECKPOINT_DIR": str(ckpt),
        "TORCHRELAY_CHECKPOINT_EVERY_S": "0.4",
        "TORCHRELAY_CHECKPOINT_KEEP": "50",
    }
    timed, _ = await runner.start("timed", nproc=2, env=timed_env, script=SCRIPT)
    assert await timed.wait() == 0, timed.output()[-4000:]
    manifests = [json.loads(p.read_text()) for p in sorted(ckpt.glob("*/torchrelay.json"))]
    # 30 steps of >= 50 ms: at least 1.5 s, so at least 2 checkpoints 0.4 s apart.
    assert len(manifests) >= 2, sorted(p.name for p in ckpt.iterdir())
    assert all(m["world_size"] == 2 for m in manifests)
    assert len({m["steps"] for m in manifests}) == len(manifests)
    assert all(0 < m["steps"] <= 30 for m in manifests)
    assert _full(timed.run_dir) == _full(plain.run_dir)
