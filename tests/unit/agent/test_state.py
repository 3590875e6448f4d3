"""The tracked state moves whole and bit-exact: model, AdamW (per-parameter steps), scheduler."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from torchrelay.agent._state import (
    INLINE_MAX_BYTES,
    first_difference,
    forward_first,
    leaf_digests,
    load_entries,
    outside_state,
    pack_state,
    read_header,
    receive_locally,
    receive_targets,
    restore_outside_state,
    slots,
    split_by_arrival,
    state_digest,
    structure,
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


def sized(seed: int, steps: int, *, width: int = 256, tied: bool = False) -> dict[str, object]:
    """A model whose weights and Adam moments are large enough to travel as slots."""
    torch.manual_seed(seed)
    first, last = nn.Linear(128, width), nn.Linear(width, 128)
    model = nn.Sequential(first, nn.ReLU(), last)
    if tied:
        last.weight = nn.Parameter(first.weight.t().contiguous())
        model.register_buffer("mirror", last.weight.detach())  # the same storage, twice
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(3, 128)).sum().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model, "optimizer": opt}


def receive(source: dict[str, object], target: dict[str, object]) -> list[torch.Tensor]:
    """What a rank without state does in a sync (:func:`receive_locally`): the tensors the
    state was received into (the rank's own where it has them)."""
    step, received = receive_locally(source, target, 9)  # type: ignore[arg-type]
    assert step == 9
    return received


def slotted(t: torch.Tensor) -> bool:
    return t.numel() * t.element_size() > INLINE_MAX_BYTES  # travels apart from the header


def live_tensors(objs: dict[str, object]) -> set[int]:
    """Where the large tensors of the model and the optimizer state live."""
    model, opt = objs["model"], objs["optimizer"]
    ptrs = {t.data_ptr() for t in model.state_dict().values() if slotted(t)}  # type: ignore[attr-defined]
    for entry in opt.state.values():  # type: ignore[attr-defined]
        ptrs |= {t.data_ptr() for t in entry.values() if slotted(t)}
    return ptrs


def test_a_warmed_up_spare_receives_into_its_own_tensors_and_ends_bit_equal() -> None:
    source, spare = sized(1, 3), sized(2, 1)  # the spare's own step made its Adam moments
    before = live_tensors(spare)
    received = receive(source, spare)
    assert received
    assert {t.data_ptr() for t in received} <= before  # nothing fresh was allocated
    assert live_tensors(spare) == before  # and the state still lives where it lived
    assert state_digest(spare) == state_digest(source)  # type: ignore[arg-type]


def test_a_cold_spare_reuses_its_weights_only_and_mismatched_shapes_get_fresh_buffers() -> None:
    source = sized(1, 3)
    cold = sized(2, 0)  # no optimizer state yet: the moments need buffers of their own
    weights = live_tensors(cold)
    received = {t.data_ptr() for t in receive(source, cold)}
    assert weights <= received
    assert received - weights  # the moments
    assert state_digest(cold) == state_digest(source)  # type: ignore[arg-type]

    # Another width: the announced shapes match nothing, everything is received fresh, and
    # loading then reports the mismatch (the scripts differ).
    other = sized(3, 1, width=384)
    skeleton = read_header(pack_state(source, 9).header.clone())  # type: ignore[arg-type]
    targets = receive_targets(skeleton, other, torch.device("cpu"))  # type: ignore[arg-type]
    assert not ({t.data_ptr() for t in targets.tensors} & live_tensors(other))
    assert targets.live == []


def test_an_abandoned_receive_leaves_the_live_state_out_of_its_buffers() -> None:
    source, spare = sized(1, 3), sized(2, 1)
    skeleton = read_header(pack_state(source, 9).header.clone())  # type: ignore[arg-type]
    targets = receive_targets(skeleton, spare, torch.device("cpu"))  # type: ignore[arg-type]
    assert targets.live
    targets.release_live()
    # A late write by the abandoned group lands in memory the state no longer uses.
    written = {t.data_ptr() for t in targets.tensors}
    assert not (written & live_tensors(spare))
    for t in targets.tensors:
        t.fill_(7.0)
    model = spare["model"]
    assert all(not torch.all(t == 7.0) for t in model.state_dict().values())  # type: ignore[attr-defined]
    # The next sync receives again, into the new storage, and ends bit-equal.
    receive(source, spare)
    assert state_digest(spare) == state_digest(source)  # type: ignore[arg-type]


def test_tied_storage_is_received_into_once() -> None:
    source, spare = sized(1, 2, tied=True), sized(2, 1, tied=True)
    skeleton = read_header(pack_state(source, 9).header.clone())  # type: ignore[arg-type]
    targets = receive_targets(skeleton, spare, torch.device("cpu"))  # type: ignore[arg-type]
    ptrs = [t.data_ptr() for t in targets.tensors]
    assert len(ptrs) == len(set(ptrs))


def _trio(width: int = 4) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, width)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return {"model": model, "optimizer": opt, "scheduler": sched}


def test_leaf_digests_name_the_first_entry_that_differs() -> None:
    a, b = _trio(), _trio()
    assert leaf_digests(a) == leaf_digests(b)
    with torch.no_grad():
        b["model"].weight[0, 0] += 1e-7  # one element, a few bits
    path, ours, theirs = first_difference(leaf_digests(a), leaf_digests(b))
    assert path == "model.weight"
    assert ours != theirs
    assert first_difference(structure(a), structure(_trio(5)))[0] == "model.bias"
    assert first_difference(structure(a), structure(_trio(5)))[1:] == (
        "torch.float32[4]",
        "torch.float32[5]",
    )


def test_what_the_loop_changed_outside_the_agent_is_put_back() -> None:
    tracked = _trio()
    tracked["optimizer"].step()  # no gradients: moves nothing, but comes first as it should
    kept = outside_state(tracked)
    tracked["scheduler"].step()  # halves the optimizer's lr and moves last_epoch
    assert tracked["optimizer"].param_groups[0]["lr"] == 0.05
    restore_outside_state(tracked, kept)
    assert tracked["optimizer"].param_groups[0]["lr"] == 0.1
    assert tracked["scheduler"].last_epoch == 0
    tracked["scheduler"].step()
    assert tracked["optimizer"].param_groups[0]["lr"] == 0.05  # steps on as if never undone
