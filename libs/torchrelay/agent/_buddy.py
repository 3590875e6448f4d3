"""Buddy copies: a shard that no other rank holds, kept in another rank's host memory
(docs/design.md §12).

In pure FSDP every rank's shard is its own. At each sharded step's boundary, after the
optimizer step and before the commit, each such rank sends its state (local shards and
each DTensor's spec, as a recovery transfer sends it) to its *buddy*, the next rank in
ring order, and receives its *ward*'s. The step commits only when every copy arrived, so
a buddy always holds its ward's state at the committed step; copies are double-buffered
(the last committed one is kept until the next commit), so a failed boundary leaves it
whole. A lost rank is restored from its buddy's copy like from a replica.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from torchrelay.agent._agree import Collectives
from torchrelay.agent._state import (
    PackedState,
    Stateful,
    as_bytes,
    empty_for,
    pack_state,
    read_header,
    slots,
)

COPY_TAG = 0x5ABD  # the boundary copies' messages, apart from a recovery's (tag: generation)


@dataclass
class WardCopy:
    """The state of rank ``rank`` at committed step ``step``, held for it."""

    rank: int
    step: int
    header: torch.Tensor
    large: list[torch.Tensor]

    def packed(self) -> PackedState:
        """What a recovery sends to the rank's new holder."""
        return PackedState(self.header, [as_bytes(t) for t in self.large])


def alone(classes: Sequence[int]) -> list[bool]:
    """Which ranks hold a shard no other rank holds (those need a buddy)."""
    count = Counter(classes)
    return [count[c] == 1 for c in classes]


def buddy_of(rank: int, world: int) -> int:
    return (rank + 1) % world


def ward_of(rank: int, world: int) -> int:
    return (rank - 1) % world


def exchange_copies(
    coll: Collectives,
    classes: Sequence[int],
    tracked: Mapping[str, Stateful],
    step: int,
    reuse: WardCopy | None,
) -> WardCopy | None:
    """Send this rank's state at ``step`` to its buddy and receive its ward's.

    Returns the ward's copy (None when the ward needs none). ``reuse``: an older copy
    whose buffers may be written over (not the last committed one). The collectives raise
    the agent's Abandoned/CollectiveError.
    """
    world, rank = len(classes), coll.rank
    lonely = alone(classes)
    works = []
    if lonely[rank] and world > 1:
        own = pack_state(tracked, step, coll.device)
        works = coll.send_packed(own, buddy_of(rank, world), COPY_TAG)
    ward = ward_of(rank, world)
    copy: WardCopy | None = None
    if lonely[ward] and world > 1:
        header = coll.recv_header(ward, COPY_TAG)
        found = slots(read_header(header))
        old = reuse.large if reuse is not None and len(reuse.large) == len(found) else []
        large = [
            old[i]
            if old and old[i].dtype == slot.dtype and tuple(old[i].shape) == slot.shape
            else empty_for(slot, coll.device)
            for i, slot in enumerate(found)
        ]
        for t in large:
            coll.run(coll.pg.recv([as_bytes(t)], ward, COPY_TAG))
        copy = WardCopy(ward, step, header, large)
    for work in works:
        coll.run(work)
    return copy


__all__ = ["COPY_TAG", "WardCopy", "alone", "buddy_of", "exchange_copies", "ward_of"]
