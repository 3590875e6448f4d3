"""The tracked state moves whole and bit-exact: model, AdamW (per-parameter steps), scheduler."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchrelay.agent._state import (
    forward_first,
    load_entries,
    pack_state,
    read_header,
    slots,
    split_by_arrival,
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


def _received(source: dict[str, object], step: int) -> tuple[object, list[torch.Tensor]]:
    """What a receiver holds after the wire: the header structure and its large tensors."""
    packed = pack_state(source, step)  # type: ignore[arg-type]
    skeleton = read_header(packed.header.clone())
    large = []
    for slot, data in zip(slots(skeleton), packed.large, strict=True):
        t = torch.empty(slot.shape, dtype=slot.dtype)
        t.reshape(-1).view(torch.uint8).copy_(data)
        large.append(t)
    return skeleton, large


def big_trained(seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 256))  # > 64 KiB each
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    opt.zero_grad()
    # The optimizer tracked first: the sending order must still put the model first.
    return {"optimizer": opt, "model": model}


def test_modules_are_sent_first_and_load_before_the_optimizer_state_arrives() -> None:
    source, target = big_trained(1), big_trained(2)
    assert forward_first(source) == ["model", "optimizer"]  # type: ignore[arg-type]
    skeleton, large = _received(source, 7)
    early, count = split_by_arrival(skeleton, target)  # type: ignore[arg-type]
    assert early == ["model"]
    # The two weights travel on their own (the biases, under 64 KiB, are in the header),
    # then Adam's two moments of each weight.
    assert count == 2
    assert len(large) == 6
    # The optimizer's tensors have not "arrived": poison them; loading the model ignores them.
    arrived = [t if i < count else torch.full_like(t, float("nan")) for i, t in enumerate(large)]
    assert load_entries(skeleton, arrived, target, early) == 7  # type: ignore[arg-type]
    assert state_digest({"m": source["model"]}) == state_digest({"m": target["model"]})  # type: ignore[dict-item]
    assert state_digest(source) != state_digest(target)  # type: ignore[arg-type]
    load_entries(skeleton, large, target, ["optimizer"])  # type: ignore[arg-type]
    assert state_digest(source) == state_digest(target)  # type: ignore[arg-type]


def test_without_modules_nothing_is_needed_before_the_step() -> None:
    source, target = big_trained(1), big_trained(2)
    skeleton, large = _received({"optimizer": source["optimizer"]}, 3)
    early, count = split_by_arrival(skeleton, {"optimizer": target["optimizer"]})  # type: ignore[dict-item]
    assert early == []
    assert count == 0
    assert len(large) == 4  # the moments of the two weights, all loaded at the step
