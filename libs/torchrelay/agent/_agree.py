"""What the ranks of a group agree on about their tracked state, and who sends it to whom.

- After a failure: the holders of the highest committed step send their state to the ranks
  below it (:func:`state_sources`).
- Before the first commit, DDP's start: every rank whose state differs from the reference's
  receives it (:func:`start_sources`); a rank that tracks other names, shapes or dtypes stops
  the job.
- The divergence guard: every rank's state is compared with rank 0's, or in a sharded job
  with its shard class's first rank (:func:`find_divergence`).

Comparisons cost one all-gather of fixed-size digests; only when they differ are the
per-entry lists of two ranks broadcast, so every rank names the same first entry.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchrelay.agent._errors import AgentError
from torchrelay.agent._state import (
    PackedState,
    Stateful,
    digest_of,
    first_difference,
    leaf_digests,
    structure,
)

NO_STATE = -2  # a member that has never held a rank's state (a spare) in the step agreement
Entries = list[tuple[str, str]]


def state_sources(steps: list[int]) -> dict[int, int]:
    """Which rank sends the state to each rank that lacks it: ``{receiver: sender}``.

    ``steps`` are the committed steps of the group's ranks (from the step agreement); the
    holders of the highest one can send. Each receiver takes it from the nearest holder
    before it in ring order: the ring's all-gather has just connected that pair (gloo
    connects a pair on first use), and two receivers are mostly served by two senders.
    """
    best = max(steps)
    world = len(steps)
    sources: dict[int, int] = {}
    for receiver, step in enumerate(steps):
        if step == best:
            continue
        for back in range(1, world):
            holder = (receiver - back) % world
            if steps[holder] == best:
                sources[receiver] = holder
                break
    return sources


@dataclass
class Collectives:
    """This rank's view of a group for the small exchanges of an agreement.

    ``run`` waits for a collective's work and raises the agent's ``Abandoned`` or
    ``CollectiveError`` when the group is left or fails.
    """

    pg: Any
    device: torch.device
    rank: int
    run: Callable[[Any], None]

    def send_packed(self, packed: PackedState, dst: int, tag: int) -> list[Any]:
        """Post the sends of a packed state to ``dst``: its header's size, the header, then
        each large tensor (the transport streams them back to back); their works."""
        size = torch.tensor([packed.header.numel()], dtype=torch.int64, device=self.device)
        return [self.pg.send([t], dst, tag) for t in (size, packed.header, *packed.large)]

    def recv_header(self, src: int, tag: int) -> torch.Tensor:
        """Receive the header :meth:`send_packed` sends first (its size, then it)."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.run(self.pg.recv([size], src, tag))
        header = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.run(self.pg.recv([header], src, tag))
        return header

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (all of one length), in rank order."""
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        outs = [torch.empty_like(mine) for _ in range(self.pg.size())]
        self.run(self.pg.allgather([outs], [mine]))
        return [bytes(t.cpu().numpy().tobytes()) for t in outs]

    def allgather_sized(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (of any lengths), in rank order: the lengths first."""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.empty_like(size) for _ in range(self.pg.size())]
        self.run(self.pg.allgather([sizes], [size]))
        lengths = [int(t.item()) for t in sizes]
        if not max(lengths):
            return [b""] * len(lengths)
        padded = data + bytes(max(lengths) - len(data))
        return [d[:n] for d, n in zip(self.allgather_bytes(padded), lengths, strict=True)]

    def broadcast_json(self, root: int, value: Any) -> Any:
        """``value`` of rank ``root`` on every rank (JSON-encodable values)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        data = json.dumps(value).encode() if self.rank == root else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.run(self.pg.broadcast([size], opts))
        if self.rank == root:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.run(self.pg.broadcast([buf], opts))
        return json.loads(buf.cpu().numpy().tobytes())

    def first_difference(
        self, reference: int, other: int, entries: Entries
    ) -> tuple[str, str | None, str | None]:
        """The first entry where rank ``other``'s list differs from rank ``reference``'s,
        with each side's text; the same answer on every rank."""
        ours = _pairs(self.broadcast_json(reference, entries))
        theirs = _pairs(self.broadcast_json(other, entries))
        return first_difference(ours, theirs)


def start_sources(
    coll: Collectives, steps: list[int], tracked: Mapping[str, Stateful], has_state: bool
) -> dict[int, int]:
    """DDP's start: who receives the reference's state before the first commit.

    The reference is the lowest rank holding state (rank 0 unless a spare took it). Holders
    whose state digest equals the reference's keep theirs; the others and the members
    without state receive it.

    Raises:
        AgentError: a holder tracks other names, shapes or dtypes than the reference.
    """
    holders = [r for r, s in enumerate(steps) if s != NO_STATE]
    reference = holders[0]
    shape: Entries = structure(tracked) if has_state else []
    mine = digest_of(shape) + digest_of(leaf_digests(tracked)) if has_state else bytes(64)
    seen = coll.allgather_bytes(mine)
    odd = [r for r in holders if seen[r][:32] != seen[reference][:32]]
    if odd:
        first = odd[0]
        path, theirs, its = coll.first_difference(reference, first, shape)
        raise AgentError(
            f"rank {first} tracks a state that does not match rank {reference}'s: "
            f"{path} is {its or 'absent'} on rank {first} but {theirs or 'absent'} on rank "
            f"{reference}; every rank must build the same model and optimizers and "
            "call job.track() with the same names"
        )
    return {
        r: reference
        for r in range(len(steps))
        if r != reference and (steps[r] == NO_STATE or seen[r][32:] != seen[reference][32:])
    }


@dataclass(frozen=True)
class Divergence:
    """Ranks whose tracked state differs from their reference's, and the first entry that
    does (for the first of them, against ``reference``)."""

    ranks: list[int]
    path: str
    reference: int = 0


def find_divergence(
    coll: Collectives,
    tracked: Mapping[str, Stateful],
    step: int,
    classes: list[int] | None = None,
) -> Divergence | None:
    """Compare every rank's tracked state (and committed step) with rank 0's, or in a
    sharded job with the first rank of its shard class (``classes``, one per rank)."""
    entries: Entries = [("step", str(step)), *leaf_digests(tracked)]
    seen = coll.allgather_bytes(digest_of(entries))
    refs = classes if classes is not None else [0] * len(seen)
    odd = [r for r, d in enumerate(seen) if d != seen[refs[r]]]
    if not odd:
        return None
    path, _, _ = coll.first_difference(refs[odd[0]], odd[0], entries)
    return Divergence(odd, path, refs[odd[0]])


def _pairs(value: Any) -> Entries:
    """``(path, text)`` entries back from their JSON form (lists of two strings)."""
    return [(str(path), str(text)) for path, text in value]
