"""Checkpoints through DCP: written as the ranks would write them (each its part, the
coordinator the metadata and the manifest), loaded bit for bit, and refused when incomplete
or corrupted, naming the file."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchrelay.agent._checkpoint import (
    CheckpointSettings,
    CheckpointWrite,
    checkpoint_settings,
    load_checkpoint,
    newest_loadable,
    stage,
)
from torchrelay.agent._errors import AgentError
from torchrelay.agent._state import state_digest
from torchrelay.checkpoints import (
    CheckpointError,
    complete_checkpoints,
    read_manifest,
    step_dir,
    usable_checkpoint,
)


def _tracked(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler}


def _train(tracked: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        loss = tracked["model"](torch.randn(4, 6)).pow(2).sum()
        loss.backward()
        tracked["optimizer"].step()
        tracked["scheduler"].step()
        tracked["optimizer"].zero_grad()


def _save(
    root: Path, tracked: dict[str, Any], steps: int, world: int = 3, keep: int = 2, parts: int = 0
) -> list[CheckpointWrite]:
    """Every rank's part of one checkpoint, from one process (the plans exchanged as the
    agents' all-gather would); ``parts`` < world leaves the last ranks' parts unwritten."""
    settings = CheckpointSettings(root, every=1, keep=keep)
    writes = [
        CheckpointWrite(root, stage(tracked, steps), r, world, settings) for r in range(world)
    ]
    plans = [w.local_plan() for w in writes]
    count = parts or world
    # The coordinator gives up waiting once the parts that will come have come.
    for w in writes[:count]:
        w.start(plans, lambda: count < world and all(w.done.is_set() for w in writes[1:count]))
    for w in writes[1:count]:
        assert w.wait(30)
    writes[0].wait(30)
    return writes


def test_a_checkpoint_loads_into_fresh_objects_bit_for_bit(tmp_path: Path) -> None:
    tracked = _tracked()
    _train(tracked, 5)
    [coordinator, *_] = _save(tmp_path, tracked, 5)
    assert coordinator.error is None
    fresh = _tracked(seed=1)  # other weights, an optimizer with no state yet
    assert state_digest(fresh) != state_digest(tracked)
    found = read_manifest(step_dir(tmp_path, 5))
    assert found.world_size == 3
    assert load_checkpoint(found, fresh) == 5
    assert state_digest(fresh) == state_digest(tracked)
    # The optimizer's state is keyed by parameter index again, so it drives the next steps
    # exactly as the original's does.
    assert sorted(fresh["optimizer"].state_dict()["state"]) == [0, 1, 2, 3]
    for objs in (tracked, fresh):
        torch.manual_seed(7)
        _train(objs, 3)
    assert state_digest(fresh) == state_digest(tracked)


def test_every_rank_writes_a_share_of_a_replicated_state(tmp_path: Path) -> None:
    tracked = _tracked()
    _train(tracked, 1)
    _save(tmp_path, tracked, 1)
    files = read_manifest(step_dir(tmp_path, 1)).files
    assert {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp", ".metadata"} <= set(files)


def test_a_checkpoint_missing_a_part_is_never_complete(tmp_path: Path) -> None:
    tracked = _tracked()
    _train(tracked, 1)
    [coordinator, *_] = _save(tmp_path, tracked, 10, parts=2)
    assert isinstance(coordinator.error, CheckpointError)
    assert "no part from __2.g0.results" in str(coordinator.error)
    assert complete_checkpoints(tmp_path) == []
    with pytest.raises(CheckpointError, match="is incomplete"):
        read_manifest(step_dir(tmp_path, 10))


def test_a_corrupted_newest_checkpoint_is_refused_and_the_one_before_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tracked = _tracked()
    _train(tracked, 2)
    _save(tmp_path, tracked, 2)
    expected = state_digest(tracked)
    _train(tracked, 2)
    _save(tmp_path, tracked, 4)
    part = step_dir(tmp_path, 4) / "__1_0.distcp"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))
    fresh = _tracked(seed=3)
    found, steps = newest_loadable(tmp_path, fresh)
    assert found is not None
    assert steps == 2
    assert state_digest(fresh) == expected
    assert f"{part} is corrupted" in capsys.readouterr().err
    assert usable_checkpoint(tmp_path) == found


def test_only_the_newest_keep_checkpoints_stay(tmp_path: Path) -> None:
    tracked = _tracked()
    for steps in (1, 2, 3):
        _train(tracked, 1)
        _save(tmp_path, tracked, steps, keep=2)
    _save(tmp_path, tracked, 4, parts=2)  # cut short: incomplete, newer than the rest
    assert [f.steps for f in complete_checkpoints(tmp_path)] == [3, 2]
    assert not step_dir(tmp_path, 1).exists()
    assert step_dir(tmp_path, 4).exists()
    _save(tmp_path, tracked, 5, keep=2)  # the incomplete one is now older than a complete
    assert [f.steps for f in complete_checkpoints(tmp_path)] == [5, 3]
    assert not step_dir(tmp_path, 4).exists()


def test_an_earlier_attempts_parts_are_never_mixed_in(tmp_path: Path) -> None:
    tracked = _tracked()
    _save(tmp_path, tracked, 6, parts=2)  # generation 0's attempt: rank 2's part missing
    _train(tracked, 1)
    settings = CheckpointSettings(tmp_path, every=1, keep=2)
    # Generation 1 writes the same checkpoint again; its coordinator ignores g0's parts.
    writes = [CheckpointWrite(tmp_path, stage(tracked, 6), r, 3, settings, "g1") for r in range(3)]
    plans = [w.local_plan() for w in writes]
    # Rank 1 comes last: g0's part of it is on disk all along, and must not be taken.
    writes[2].start(plans, lambda: False)
    assert writes[2].wait(30)
    writes[0].start(plans, lambda: False)
    time.sleep(0.5)
    writes[1].start(plans, lambda: False)
    assert all(w.wait(30) for w in writes)
    fresh = _tracked(seed=5)
    load_checkpoint(read_manifest(step_dir(tmp_path, 6)), fresh)
    assert state_digest(fresh) == state_digest(tracked)


def test_a_checkpoint_of_other_names_is_refused(tmp_path: Path) -> None:
    tracked = _tracked()
    _save(tmp_path, tracked, 1)
    other = {"model": _tracked()["model"]}
    with pytest.raises(CheckpointError, match=r"holds \['model', 'optimizer', 'scheduler'\]"):
        load_checkpoint(read_manifest(step_dir(tmp_path, 1)), other)


def test_a_manifest_that_does_not_describe_its_folder_is_refused(tmp_path: Path) -> None:
    _save(tmp_path, _tracked(), 1)
    manifest = step_dir(tmp_path, 1) / "torchrelay.json"
    data = json.loads(manifest.read_text())
    data["steps"] = 7
    manifest.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="does not describe this checkpoint"):
        read_manifest(step_dir(tmp_path, 1))


def test_settings_come_from_the_arguments_then_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("DIR", "EVERY", "KEEP"):
        monkeypatch.delenv(f"TORCHRELAY_CHECKPOINT_{name}", raising=False)
    assert checkpoint_settings(None, None, None) is None
    monkeypatch.setenv("TORCHRELAY_CHECKPOINT_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHRELAY_CHECKPOINT_EVERY", "50")
    assert checkpoint_settings(None, None, None) == CheckpointSettings(tmp_path, 50, 2)
    assert checkpoint_settings(tmp_path / "x", 5, 3) == CheckpointSettings(tmp_path / "x", 5, 3)
    monkeypatch.delenv("TORCHRELAY_CHECKPOINT_EVERY")
    monkeypatch.setenv("TORCHRELAY_CHECKPOINT_EVERY_S", "2.5")
    assert checkpoint_settings(None, None, None) == CheckpointSettings(tmp_path, None, 2, 2.5)
    assert checkpoint_settings(None, 7, None, 60) == CheckpointSettings(tmp_path, 7, 2, 60.0)


@pytest.mark.parametrize(
    ("directory", "every", "keep", "every_s", "message"),
    [
        (None, 10, None, None, "checkpoint_every needs checkpoint_dir"),
        (None, None, None, 30, "checkpoint_every needs checkpoint_dir"),
        ("ck", None, None, None, "needs checkpoint_every .* or checkpoint_every_s"),
        ("ck", 0, None, None, r"checkpoint_every=0: give a whole number >= 1"),
        ("ck", "ten", None, None, "checkpoint_every='ten' is not a whole number"),
        ("ck", 10, 0, None, r"checkpoint_keep=0: give a whole number >= 1"),
        ("ck", None, None, "0", r"checkpoint_every_s=0.0: give a number of seconds > 0"),
        ("ck", None, None, "soon", "checkpoint_every_s='soon' is not a number of seconds"),
        ("ck", None, None, True, r"checkpoint_every_s=True: give a number of seconds"),
    ],
)
def test_bad_checkpoint_settings_are_named(
    monkeypatch: pytest.MonkeyPatch,
    directory: Any,
    every: Any,
    keep: Any,
    every_s: Any,
    message: str,
) -> None:
    for name in ("DIR", "EVERY", "KEEP", "EVERY_S"):
        monkeypatch.delenv(f"TORCHRELAY_CHECKPOINT_{name}", raising=False)
    with pytest.raises(AgentError, match=message):
        checkpoint_settings(directory, every, keep, every_s)
