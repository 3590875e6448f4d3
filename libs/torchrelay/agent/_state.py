"""The tracked state of a rank: packed into bytes for recovery, and digested for tests.

Recovery moves *everything* a rank's future depends on: each tracked object's
``state_dict()`` (model, optimizer with its per-parameter ``step`` tensors, schedulers)
and the step counter. Leaving any of it behind makes the new rank's updates differ, and
the all-reduce spreads the difference to every rank.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping
from typing import Any, Protocol

import torch


class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


def pack_state(tracked: Mapping[str, Stateful], step: int) -> bytes:
    """``torch.save`` bytes of every tracked state dict and the committed step."""
    buf = io.BytesIO()
    torch.save(
        {"step": step, "state": {name: obj.state_dict() for name, obj in tracked.items()}}, buf
    )
    return buf.getvalue()


def unpack_state(data: bytes, tracked: Mapping[str, Stateful]) -> int:
    """Load bytes from :func:`pack_state` into the tracked objects; returns the step.

    Raises:
        ValueError: the sender tracked different names than this process.
    """
    # The bytes come from a peer of the same job over its own process group, which runs the
    # same script: they are as trusted as the script, and optimizer/scheduler state dicts
    # may hold objects that weights_only loading refuses.
    payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    state = payload["state"]
    if set(state) != set(tracked):
        raise ValueError(
            f"the recovery source tracks {sorted(state)} but this process tracks "
            f"{sorted(tracked)}: call job.track() with the same names everywhere"
        )
    for name, obj in tracked.items():
        obj.load_state_dict(state[name])
    return int(payload["step"])


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
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


def state_digest(tracked: Mapping[str, Stateful], step: int | None = None) -> str:
    """sha256 over the exact bits of every tracked state (and ``step`` if given)."""
    h = hashlib.sha256()
    for name in sorted(tracked):
        h.update(name.encode())
        _feed(h, tracked[name].state_dict())
    if step is not None:
        h.update(f"step={step}".encode())
    return h.hexdigest()
