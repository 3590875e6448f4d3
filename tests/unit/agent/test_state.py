"""The tracked state moves whole and bit-exact: model, AdamW (per-parameter steps), scheduler."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchrelay.agent._state import pack_state, state_digest, unpack_state


def trained(seed: int, steps: int) -> dict[str, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return {"model": model, "optimizer": opt, "scheduler": sched}


def test_pack_and_unpack_reproduce_every_bit() -> None:
    source = trained(1, 3)
    target = trained(2, 0)  # a fresh spare: no optimizer state at all
    assert state_digest(source) != state_digest(target)  # type: ignore[arg-type]
    step = unpack_state(pack_state(source, 41), target)  # type: ignore[arg-type]
    assert step == 41
    assert state_digest(source) == state_digest(target)  # type: ignore[arg-type]
    # And they stay equal when both continue identically.
    for objs in (source, target):
        torch.manual_seed(5)
        model, opt = objs["model"], objs["optimizer"]
        model(torch.randn(3, 4)).sum().backward()  # type: ignore[operator]
        opt.step()  # type: ignore[attr-defined]
    assert state_digest(source) == state_digest(target)  # type: ignore[arg-type]


def test_digest_sees_a_single_bit() -> None:
    objs = trained(1, 1)
    before = state_digest(objs)  # type: ignore[arg-type]
    weight = objs["model"][0].weight  # type: ignore[index]
    with torch.no_grad():
        weight.view(-1).view(torch.int32)[0] ^= 1
    assert state_digest(objs) != before  # type: ignore[arg-type]


def test_different_tracked_names_are_refused() -> None:
    objs = trained(1, 0)
    data = pack_state({"model": objs["model"]}, 0)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="same names"):
        unpack_state(data, objs)  # type: ignore[arg-type]
