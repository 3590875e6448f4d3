"""The tracked state moves whole and bit-exact: model, AdamW (per-parameter steps), scheduler."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchrelay.agent._state import (
    pack_state,
    read_header,
    slots,
    state_digest,
    transfer_locally,
    unpack_state,
)


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
    step = transfer_locally(source, target, 41)  # type: ignore[arg-type]
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
    with pytest.raises(ValueError, match="same names"):
        transfer_locally({"model": objs["model"]}, objs, 0)  # type: ignore[dict-item, arg-type]


def big() -> dict[str, object]:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


def test_large_tensors_travel_apart_from_the_header_without_a_copy() -> None:
    source = big()
    packed = pack_state(source, 7)  # type: ignore[arg-type]
    weight = source["model"][0].weight  # type: ignore[index]
    # The two 256x512 moments and the weight go as views of the state itself, not copies.
    assert any(t.data_ptr() == weight.data_ptr() for t in packed.large)
    assert packed.header.numel() < 64 * 1024
    announced = slots(read_header(packed.header))
    assert len(announced) == len(packed.large) >= 3
    target = big()
    with torch.no_grad():
        target["model"][0].weight.add_(1.0)  # type: ignore[index]
    assert state_digest(source) != state_digest(target)  # type: ignore[arg-type]
    assert transfer_locally(source, target, 7) == 7  # type: ignore[arg-type]
    assert state_digest(source) == state_digest(target)  # type: ignore[arg-type]


def test_a_short_tensor_list_and_a_garbled_header_are_refused() -> None:
    source = big()
    packed = pack_state(source, 1)  # type: ignore[arg-type]
    skeleton = read_header(packed.header)
    with pytest.raises(ValueError, match="announces"):
        unpack_state(skeleton, [], big())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="malformed"):
        read_header(packed.header[: packed.header.numel() // 2])
