"""The tracked state of a rank: packed into bytes for recovery, and digested for tests.

Recovery moves *everything* a rank's future depends on: each tracked object's
``state_dict()`` (model, optimizer with its per-parameter ``step`` tensors, schedulers)
and the step counter. Leaving any of it behind makes the new rank's updates differ, and
the all-reduce spreads the difference to every rank.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import io
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from torchrelay.agent._shards import ShardSpec, is_dtensor, rebuild, spec_of

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchrelay.contract import Generation


class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


INLINE_MAX_BYTES = 64 * 1024  # smaller tensors travel inside the pickled header


@dataclass(frozen=True)
class _Slot:
    """A large tensor of the state, sent on its own: its index, dtype and shape."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    on_cpu: bool


def _is_dense(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and not value.is_quantized
        and not value.is_nested
    )


@dataclass(frozen=True)
class _Sharded:
    """A DTensor of the state: this rank's local shard (itself stripped) and its spec."""

    spec: ShardSpec
    local: Any


def _strip(value: Any, large: list[torch.Tensor]) -> Any:
    """The state with every large dense tensor replaced by a :class:`_Slot` into ``large``
    and every DTensor by its local shard (:class:`_Sharded`)."""
    if is_dtensor(value):
        return _Sharded(spec_of(value), _strip(local_view(value), large))
    if _is_dense(value) and value.numel() * value.element_size() > INLINE_MAX_BYTES:
        large.append(value.detach())
        return _Slot(len(large) - 1, value.dtype, tuple(value.shape), value.device.type == "cpu")
    if type(value) in (dict, OrderedDict):
        return type(value)((k, _strip(v, large)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_strip(v, large) for v in value)
    return value  # small tensors and anything else are pickled in the header as they are


def _fill(value: Any, large: list[torch.Tensor], mesh: DeviceMesh | None = None) -> Any:
    if isinstance(value, _Slot):
        return large[value.index]
    if isinstance(value, _Sharded):
        if mesh is None:
            raise ValueError(
                "the recovery source sent a sharded (DTensor) state but this process has "
                "no device mesh: build it with job.device_mesh() on every rank"
            )
        return rebuild(value.spec, _fill(value.local, large), mesh)
    if type(value) in (dict, OrderedDict):
        return type(value)((k, _fill(v, large, mesh)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_fill(v, large, mesh) for v in value)
    return value


@dataclass(frozen=True)
class PackedState:
    """The tracked state split for sending: a small header and the large tensors as they are.

    ``header`` (``uint8``) is the pickled structure: dict keys, hyper-parameters, the small
    tensors (Adam's per-parameter ``step``), and a slot for each large tensor. ``large`` are
    the large tensors themselves as flat ``uint8`` views on the group's device, so sending
    them copies nothing on the sender: no ``torch.save`` of the weights and moments, no
    intermediate buffer.
    """

    header: torch.Tensor
    large: list[torch.Tensor]


def forward_first(tracked: Mapping[str, Stateful]) -> list[str]:
    """The tracked names in sending order: modules (what a forward pass reads) first.

    A receiver can run its first forward and backward once the modules arrived, while the
    optimizer and scheduler states (for Adam, twice the model's bytes) are still on the way;
    they are needed only when the optimizer steps.
    """
    return sorted(tracked, key=lambda name: not isinstance(tracked[name], torch.nn.Module))


def pack_state(
    tracked: Mapping[str, Stateful], step: int, device: torch.device | None = None
) -> PackedState:
    """Split every tracked state dict and the committed step for sending to ``device``.

    The large tensors are numbered (and sent) in :func:`forward_first` order.
    """
    device = device or torch.device("cpu")
    large: list[torch.Tensor] = []
    skeleton = _strip(
        {
            "step": step,
            "state": _state_dicts(tracked),
        },
        large,
    )
    meta = io.BytesIO()
    torch.save(skeleton, meta)
    header = torch.frombuffer(bytearray(meta.getvalue()), dtype=torch.uint8).to(device)
    flat = [t.to(device).contiguous().reshape(-1).view(torch.uint8) for t in large]
    return PackedState(header, flat)


@dataclass
class Snapshot:
    """A copy of the tracked state (each DTensor's local shard) taken before a sharded
    step's optimizer step, to put back if the step does not commit (docs/design.md §12)."""

    skeleton: Any
    large: list[torch.Tensor]


def take_snapshot(tracked: Mapping[str, Stateful], reuse: Snapshot | None = None) -> Snapshot:
    """Copy every tracked state dict; into ``reuse``'s buffers where they fit (the last
    step's snapshot, once that step committed), so a step's copy allocates nothing."""
    live: list[torch.Tensor] = []
    skeleton = copy.deepcopy(_strip({"step": -1, "state": _state_dicts(tracked)}, live))
    old = reuse.large if reuse is not None and len(reuse.large) == len(live) else []
    large = []
    for i, t in enumerate(live):
        into = old[i] if old and _same_layout(old[i], t) else None
        large.append(into.copy_(t) if into is not None else t.clone())
    return Snapshot(skeleton, large)


def _state_dicts(tracked: Mapping[str, Stateful]) -> dict[str, Any]:
    return {name: tracked[name].state_dict() for name in forward_first(tracked)}


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device


def restore_snapshot(
    snap: Snapshot, tracked: Mapping[str, Stateful], mesh: DeviceMesh | None
) -> None:
    """Put the state a :class:`Snapshot` copied back into ``tracked``. The optimizers may
    keep the snapshot's tensors as their state: it must not be reused afterwards."""
    load_entries(snap.skeleton, snap.large, tracked, None, mesh)


def warm_serialization() -> None:
    """Pickle and unpickle a tiny state once: the first ``torch.save`` in a process costs a
    few ms more (measured: a sender's first :func:`pack_state` of the bench's model 5-6 ms,
    the next ones about 2), which would otherwise fall on its first recovery."""
    meta = io.BytesIO()
    torch.save({"step": 0, "state": {"t": torch.zeros(1)}}, meta)
    torch.load(io.BytesIO(meta.getvalue()), map_location="cpu", weights_only=False)


def read_header(header: torch.Tensor) -> Any:
    """The structure in a received header (its large tensors still slots)."""
    # The bytes come from a peer of the same job over its own process group, which runs the
    # same script: they are as trusted as the script, and optimizer/scheduler state dicts
    # may hold objects that weights_only loading refuses.
    try:
        return torch.load(
            io.BytesIO(header.cpu().numpy().tobytes()), map_location="cpu", weights_only=False
        )
    except Exception as exc:
        raise ValueError(f"recovery state header is malformed: {exc}") from exc


def slots(skeleton: Any) -> list[_Slot]:
    """The large tensors a header announces, in sending order."""
    found: list[_Slot] = []

    def walk(value: Any) -> None:
        if isinstance(value, _Slot):
            found.append(value)
        elif isinstance(value, _Sharded):
            walk(value.local)
        elif type(value) in (dict, OrderedDict):
            for v in value.values():
                walk(v)
        elif type(value) in (list, tuple):
            for v in value:
                walk(v)

    walk(skeleton)
    return sorted(found, key=lambda s: s.index)


def empty_for(slot: _Slot, device: torch.device) -> torch.Tensor:
    """A tensor to receive ``slot`` into (receive into its flat ``uint8`` view)."""
    return torch.empty(slot.shape, dtype=slot.dtype, device=device)


@dataclass
class ReceiveTargets:
    """Where each tensor a header announces is received, in sending order.

    ``live`` undoes the use of the receiver's own tensors: each call gives one of them a
    fresh storage in its owner (module parameter or buffer, optimizer state entry). A
    receive that is abandoned may still be written into later by the abandoned group, so
    the live state must stop using that memory before anything else is received.
    """

    tensors: list[torch.Tensor]
    live: list[Callable[[], None]] = field(default_factory=list)

    def release_live(self) -> None:
        """Detach the live state from every tensor a pending receive may still write."""
        undo, self.live = self.live, []
        for fresh in undo:
            fresh()


@dataclass
class PendingState:
    """A received state whose modules are loaded while the rest is still arriving."""

    gen: Generation
    pg: Any
    skeleton: Any
    large: list[torch.Tensor]
    works: list[Any]
    loaded: list[str]
    targets: ReceiveTargets


def _fresh_data(t: torch.Tensor) -> None:
    t.data = torch.empty_like(t)


def _fresh_entry(state: dict[Any, Any], key: Any) -> None:
    state[key] = torch.empty_like(state[key])


def _optimizer_params(opt: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """The parameter of each index in ``opt.state_dict()["state"]`` (torch's numbering)."""
    by_id: dict[int, tuple[int, torch.Tensor]] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                by_id[id(p)] = (len(by_id), p)
    return dict(by_id.values())


def receive_targets(
    skeleton: Any, tracked: Mapping[str, Stateful], device: torch.device
) -> ReceiveTargets:
    """Receive each announced tensor straight into the matching tensor this rank holds.

    A module's parameters and buffers and an optimizer's state tensors (a hot spare that
    warmed up has them) already have their memory mapped: receiving into them saves the
    page faults of fresh buffers, which on a loaded host took as long as the copy itself,
    and the copy from the buffers into the state. A tensor matches when its name, dtype,
    shape and device are the announced ones and it is contiguous; the others (and those of
    other tracked objects) are received into fresh buffers. Nothing is loaded here:
    :func:`load_entries` still loads every received tensor, which for a reused one costs
    nothing.
    """
    found = slots(skeleton)
    chosen: dict[int, torch.Tensor] = {}
    live: list[Callable[[], None]] = []
    used: set[int] = set()

    def take(slot: Any, t: Any, undo: Callable[[], None]) -> None:
        if not (
            isinstance(slot, _Slot)
            and isinstance(t, torch.Tensor)
            and not is_dtensor(t)  # FSDP2 owns a shard's storage: load_state_dict copies
            and _is_dense(t)
            and t.device == device
            and (t.device.type == "cpu") == slot.on_cpu
            and t.dtype == slot.dtype
            and tuple(t.shape) == slot.shape
            and t.is_contiguous()
            and t.numel() > 0
            and t.data_ptr() not in used  # tied weights: each storage is received once
        ):
            return
        used.add(t.data_ptr())
        chosen[slot.index] = t.detach()
        live.append(undo)

    state = skeleton["state"]
    for name, obj in tracked.items():
        sent = state.get(name)
        if not isinstance(sent, Mapping):
            continue
        if isinstance(obj, torch.nn.Module):
            own = obj.state_dict(keep_vars=True)
            for key, slot in sent.items():
                t = own.get(key)
                if isinstance(t, torch.Tensor):
                    take(slot, t, functools.partial(_fresh_data, t))
        elif isinstance(obj, torch.optim.Optimizer) and isinstance(sent.get("state"), Mapping):
            params = _optimizer_params(obj)
            for index, entry in sent["state"].items():
                param = params.get(index)
                own_entry = obj.state.get(param) if param is not None else None
                if not isinstance(entry, Mapping) or not isinstance(own_entry, dict):
                    continue
                for key, slot in entry.items():
                    take(slot, own_entry.get(key), functools.partial(_fresh_entry, own_entry, key))
    tensors = [
        chosen[slot.index] if slot.index in chosen else empty_for(slot, device) for slot in found
    ]
    return ReceiveTargets(tensors, live)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The flat ``uint8`` view of a contiguous tensor (what travels on the wire)."""
    return t.reshape(-1).view(torch.uint8)


def check_names(skeleton: Any, tracked: Mapping[str, Stateful]) -> None:
    """Raise ValueError unless the sender tracked exactly the names this process tracks."""
    state = skeleton["state"]
    if set(state) != set(tracked):
        raise ValueError(
            f"the recovery source tracks {sorted(state)} but this process tracks "
            f"{sorted(tracked)}: call job.track() with the same names everywhere"
        )


def split_by_arrival(skeleton: Any, tracked: Mapping[str, Stateful]) -> tuple[list[str], int]:
    """The names a forward pass needs (modules) and how many large tensors they span.

    Those tensors are the first ones sent (:func:`pack_state` numbers them in
    :func:`forward_first` order), so they can be loaded before the rest has arrived.
    """
    check_names(skeleton, tracked)
    early = [name for name in forward_first(tracked) if isinstance(tracked[name], torch.nn.Module)]
    indices = [slot.index for slot in slots({name: skeleton["state"][name] for name in early})]
    if indices != list(range(len(indices))):
        return [], len(slots(skeleton))  # sent in another order: wait for everything
    return early, len(indices)


def load_entries(
    skeleton: Any,
    large: list[torch.Tensor],
    tracked: Mapping[str, Stateful],
    names: list[str] | None = None,
    mesh: DeviceMesh | None = None,
) -> int:
    """Load the received state of ``names`` (default: all) into ``tracked``; the step.

    Only the large tensors of ``names`` need to have arrived. DTensors are rebuilt on
    ``mesh`` (the job's device mesh) from the local shards sent.
    """
    found = slots(skeleton)
    if len(found) != len(large):
        raise ValueError(f"recovery state announces {len(found)} tensors, got {len(large)}")
    check_names(skeleton, tracked)
    wanted = names if names is not None else list(tracked)
    needed = {slot.index for name in wanted for slot in slots(skeleton["state"][name])}
    # A tensor that lived on the CPU at the sender goes back there; only the loaded ones
    # (the others may still be arriving).
    placed = [
        t.cpu() if slot.index in needed and slot.on_cpu and t.device.type != "cpu" else t
        for slot, t in zip(found, large, strict=True)
    ]
    for name in wanted:
        tracked[name].load_state_dict(_fill(skeleton["state"][name], placed, mesh))
    return int(skeleton["step"])


def unpack_state(skeleton: Any, large: list[torch.Tensor], tracked: Mapping[str, Stateful]) -> int:
    """Load a received state (header structure + its large tensors) into ``tracked``.

    Returns the step. Raises ValueError when the sender tracked different names.
    """
    return load_entries(skeleton, large, tracked)


def transfer_locally(
    tracked_from: Mapping[str, Stateful], tracked_to: Mapping[str, Stateful], step: int
) -> int:
    """Pack, "send" by copying, and unpack within one process (tests, benchmarks).

    The receiving side is the agent's: each tensor lands in ``tracked_to``'s matching one
    where it has it (:func:`receive_targets`). Returns the step received.
    """
    return receive_locally(tracked_from, tracked_to, step)[0]


def receive_locally(
    tracked_from: Mapping[str, Stateful], tracked_to: Mapping[str, Stateful], step: int
) -> tuple[int, list[torch.Tensor]]:
    """:func:`transfer_locally`, also returning the tensors the state was received into."""
    packed = pack_state(tracked_from, step)
    skeleton = read_header(packed.header.clone())
    targets = receive_targets(skeleton, tracked_to, torch.device("cpu"))
    for into, data in zip(targets.tensors, packed.large, strict=True):
        as_bytes(into).copy_(data)
    return unpack_state(skeleton, targets.tensors, tracked_to), targets.tensors


def local_view(value: torch.Tensor) -> torch.Tensor:
    """This rank's own bits of a tensor: a DTensor's local shard (reading the whole
    DTensor would be a collective), any other tensor as it is."""
    local = getattr(value, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else value


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = local_view(value).detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, Mapping):
        h.update(b"{")
        for key in sorted(value, key=repr):
            h.update(repr(key).encode())
            _feed(h, value[key])
        h.update(b"}")
    elif isinstance(value, list | tuple):
        h.update(b"[")
        for item in value:
            _feed(h, item)
        h.update(b"]")
    else:
        h.update(repr(value).encode())


def _leaves(prefix: str, value: Any, out: list[tuple[str, Any]]) -> None:
    """Every leaf of a state dict with its dotted path (tensors and plain values)."""
    if isinstance(value, Mapping):
        for key in sorted(value, key=repr):
            _leaves(f"{prefix}.{key}", value[key], out)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _leaves(f"{prefix}[{i}]", item, out)
    else:
        out.append((prefix, value))


def state_leaves(tracked: Mapping[str, Stateful]) -> list[tuple[str, Any]]:
    """``(path, value)`` of every leaf of every tracked state dict, in a fixed order.

    Paths read like ``model.0.weight``, ``optimizer.state.0.exp_avg``,
    ``optimizer.param_groups[0].lr``: what an error names when two ranks differ.
    """
    out: list[tuple[str, Any]] = []
    for name in sorted(tracked):
        _leaves(name, tracked[name].state_dict(), out)
    return out


def _tensor_bytes(t: torch.Tensor) -> Any:
    """A buffer of a tensor's exact bits (no copy for a contiguous CPU tensor)."""
    t = local_view(t).detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def structure(tracked: Mapping[str, Stateful]) -> list[tuple[str, str]]:
    """What every rank of a data-parallel job must track alike: each leaf's path and, for
    a tensor, its dtype and shape (for anything else, its type)."""
    return [
        (path, f"{v.dtype}{list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__)
        for path, v in state_leaves(tracked)
    ]


def leaf_digests(tracked: Mapping[str, Stateful]) -> list[tuple[str, str]]:
    """``(path, sha256)`` of every leaf's exact bits (a tensor's bytes, else its repr)."""
    out = []
    for path, value in state_leaves(tracked):
        h = hashlib.sha256()
        if isinstance(value, torch.Tensor):
            h.update(f"T{value.dtype}{tuple(value.shape)}".encode())
            h.update(_tensor_bytes(value))
        else:
            h.update(repr(value).encode())
        out.append((path, h.hexdigest()))
    return out


def digest_of(entries: list[tuple[str, str]]) -> bytes:
    """One 32-byte sha256 over a list of ``(path, text)`` entries."""
    h = hashlib.sha256()
    for path, text in entries:
        h.update(path.encode())
        h.update(b"\0")
        h.update(text.encode())
        h.update(b"\n")
    return h.digest()


def first_difference(
    ours: list[tuple[str, str]], theirs: list[tuple[str, str]]
) -> tuple[str, str | None, str | None]:
    """The first path where two entry lists differ, with each side's text (None: absent)."""
    mine, other = dict(ours), dict(theirs)
    for path, text in ours:
        if other.get(path) != text:
            return path, text, other.get(path)
    for path, text in theirs:
        if path not in mine:
            return path, None, text
    return "", None, None


@dataclass(frozen=True)
class OutsideState:
    """What a training loop may change in tracked objects between two steps without the
    agent: the objects that are neither modules nor optimizers (schedulers, counters) and
    the optimizers' hyper-parameters (a scheduler sets ``lr`` there)."""

    others: dict[str, Any]
    groups: dict[str, list[dict[str, Any]]]


def outside_state(tracked: Mapping[str, Stateful]) -> OutsideState:
    """A copy of :class:`OutsideState` of ``tracked`` now."""
    others = {
        name: copy.deepcopy(obj.state_dict())
        for name, obj in tracked.items()
        if not isinstance(obj, torch.nn.Module | torch.optim.Optimizer)
    }
    groups = {
        name: [
            {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            for group in obj.param_groups
        ]
        for name, obj in tracked.items()
        if isinstance(obj, torch.optim.Optimizer)
    }
    return OutsideState(others, groups)


def restore_outside_state(tracked: Mapping[str, Stateful], kept: OutsideState) -> None:
    """Put back what :func:`outside_state` copied."""
    for name, state in kept.others.items():
        tracked[name].load_state_dict(state)
    for name, groups in kept.groups.items():
        opt = tracked[name]
        assert isinstance(opt, torch.optim.Optimizer)
        for group, saved in zip(opt.param_groups, groups, strict=True):
            group.update(saved)


def state_digest(tracked: Mapping[str, Stateful], step: int | None = None) -> str:
    """sha256 over the exact bits of every tracked state (and ``step`` if given)."""
    h = hashlib.sha256()
    for name in sorted(tracked):
        h.update(name.encode())
        _feed(h, tracked[name].state_dict())
    if step is not None:
        h.update(f"step={step}".encode())
    return h.hexdigest()
