"""Where ``job.batches`` takes each step's micro-batches from, whoever holds the rank.

Three feeds, chosen by what the loop passes:

- a map-style dataset: the batches are built here from :class:`StepSampler`'s indices;
- a ``DataLoader`` whose ``batch_sampler`` is a :class:`StepBatchSampler` (workers,
  ``pin_memory``, prefetch): the sampler is moved to the step, and the loader's iterator is
  made again only when the step, the rank or the world size is not the one it is at;
- a loader with ``state_dict()``/``load_state_dict()`` (torchdata's ``StatefulDataLoader``
  over an iterable or streaming dataset): its position cannot be computed from the step,
  so every rank's position after each step's batches is exchanged with the group before
  the step, and the table of the last committed step is tracked state
  (:class:`DataPositions`): it moves to a spare with the rest, which resumes the rank's
  stream where the lost rank had committed it.

Each step: :meth:`Feed.prepare` (may make an iterator, which draws from torch's default
generator), then the step's seeds, then :meth:`Feed.draw`: so the data and every random
number of (step, rank) are the same whoever holds the rank.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from torchrelay.agent._data import (
    StepBatchSampler,
    StepSampler,
    dataset_length,
    make_batch,
    seed_step,
)
from torchrelay.agent._errors import AgentError

POSITIONS = "_torchrelay_data"  # the tracked name of the stateful feed's position table


class DataPositions:
    """Every rank's loader position after the last committed step (tracked state)."""

    def __init__(self) -> None:
        self.step = -1
        self.states: list[bytes] = []

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "states": list(self.states)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.states = [bytes(s) for s in state["states"]]


class Feed:
    """The micro-batches of (step, rank); see the module's docstring."""

    seed: int
    accumulate: int

    def prepare(self, step: int, stop: int, rank: int, world_size: int) -> None:
        """Be ready to draw ``step`` of ``rank`` (before the step's seeds are set)."""

    def draw(self, step: int, rank: int) -> Iterator[Any]:
        """The step's micro-batches (after the step's seeds are set)."""
        raise NotImplementedError

    @property
    def drawn(self) -> bytes | None:
        """This rank's position after the step just drawn, where it must be exchanged."""
        return None

    def committed(self, step: int, positions: list[bytes] | None) -> None:
        """The step committed; ``positions`` are every rank's (stateful feeds)."""


class MapFeed(Feed):
    """A map-style dataset, batched here."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        seed: int,
        shuffle: bool,
        collate_fn: Callable[[list[Any]], Any] | None,
        accumulate: int,
    ) -> None:
        self.dataset = dataset
        self.length = dataset_length(dataset)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.collate_fn = collate_fn
        self.accumulate = accumulate
        self._sampler: StepSampler | None = None

    def prepare(self, step: int, stop: int, rank: int, world_size: int) -> None:
        if self._sampler is None or self._sampler.world_size != world_size:
            self._sampler = StepSampler(
                self.length,
                self.batch_size,
                world_size,
                seed=self.seed,
                shuffle=self.shuffle,
                accumulate=self.accumulate,
            )

    def draw(self, step: int, rank: int) -> Iterator[Any]:
        sampler = self._sampler
        assert sampler is not None
        for micro in range(self.accumulate):
            yield make_batch(self.dataset, sampler.indices(step, rank, micro), self.collate_fn)


class LoaderFeed(Feed):
    """A DataLoader over a :class:`StepBatchSampler`."""

    def __init__(self, loader: Any, sampler: StepBatchSampler, accumulate: int) -> None:
        self.loader = loader
        self.sampler = sampler
        self.seed = sampler.seed
        self.accumulate = accumulate
        self._it: Iterator[Any] | None = None
        self._at: tuple[int, int, int, int] | None = None  # (next step, stop, rank, world)

    def prepare(self, step: int, stop: int, rank: int, world_size: int) -> None:
        where = (step, stop, rank, world_size)
        if self._it is not None and self._at == where:
            return
        self.sampler.seek(step, stop, rank, world_size, self.accumulate)
        seed_step(self.seed, step, rank)  # the workers' base seed: the same for any holder
        self._it = iter(self.loader)
        self._at = where

    def draw(self, step: int, rank: int) -> Iterator[Any]:
        assert self._at is not None
        assert self._it is not None
        where, self._at = self._at, None  # until every micro-batch of the step was taken
        for _ in range(self.accumulate):
            try:
                yield next(self._it)
            except StopIteration:
                raise AgentError(
                    f"the DataLoader ended inside step {step}: give job.batches the loader "
                    "whose batch_sampler is job.sampler(...), not one wrapped around it"
                ) from None
        self._at = (step + 1, *where[1:])


class StatefulFeed(Feed):
    """A loader with ``state_dict()``: its position is exchanged every step."""

    def __init__(self, loader: Any, positions: DataPositions, seed: int, accumulate: int) -> None:
        dataset = getattr(loader, "dataset", None)
        if isinstance(dataset, IterableDataset) and not (
            callable(getattr(dataset, "state_dict", None))
            and callable(getattr(dataset, "load_state_dict", None))
        ):
            # torchdata then replays the stream to resume, and the state it reports after
            # such a resume counts the replayed samples twice (torchdata 0.11): a second
            # migration of the rank would skip data.
            raise AgentError(
                f"{type(dataset).__name__} is an IterableDataset without state_dict() and "
                "load_state_dict(): give it both (its position in the stream, per loader "
                "worker) so its position can move with the rank"
            )
        self.loader = loader
        self.positions = positions
        self.seed = seed
        self.accumulate = accumulate
        self._initial = pickle.dumps(loader.state_dict())
        self._it: Iterator[Any] | None = None
        self._at: tuple[int, int] | None = (-1, -1)  # (last step drawn, rank); -1: fresh
        self._rank: int | None = None
        self._drawn: bytes | None = None

    def prepare(self, step: int, stop: int, rank: int, world_size: int) -> None:
        if self._rank is None:
            self._rank = rank
        elif rank != self._rank:
            raise AgentError(
                f"this process's rank changed from {self._rank} to {rank}, but its stateful "
                "loader was built for one rank's shard of the stream"
            )
        if self._at == (step - 1, rank) and self._it is not None:
            return
        if self.positions.step == step - 1 and rank < len(self.positions.states):
            state = self.positions.states[rank]
        elif step == 0:
            state = self._initial
        else:
            raise AgentError(
                f"no loader position of rank {rank} after step {step - 1} "
                f"(the tracked table is at step {self.positions.step})"
            )
        # Positions come from this job's own ranks, as the state itself does (read_header).
        self.loader.load_state_dict(pickle.loads(state))  # noqa: S301
        seed_step(self.seed, step, rank)  # a fresh iterator's seeds: the same for any holder
        self._it = iter(self.loader)
        self._at = (step - 1, rank)

    def draw(self, step: int, rank: int) -> Iterator[Any]:
        assert self._it is not None
        self._at = None
        batches = []
        for _ in range(self.accumulate):
            try:
                batches.append(next(self._it))
            except StopIteration:
                raise AgentError(
                    f"the loader's data ended inside step {step}: job.batches needs "
                    "max_steps * accumulate batches per rank (repeat the stream, or stop "
                    "earlier)"
                ) from None
        self._drawn = pickle.dumps(self.loader.state_dict())
        self._at = (step, rank)
        return iter(batches)

    @property
    def drawn(self) -> bytes | None:
        return self._drawn

    def committed(self, step: int, positions: list[bytes] | None) -> None:
        assert positions is not None
        self.positions.step = step
        self.positions.states = positions


def make_feed(
    data: Any,
    batch_size: int | None,
    seed: int,
    shuffle: bool,
    collate_fn: Callable[[list[Any]], Any] | None,
    accumulate: int,
    tracked: dict[str, Any],
) -> Feed:
    """The feed for what the loop passed to ``Job.batches``; a stateful loader's position
    is tracked in ``tracked`` so that it moves with the rank."""
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be a whole number >= 1, got {accumulate!r}")
    sampler = getattr(data, "batch_sampler", None)
    if isinstance(sampler, StepBatchSampler):
        if batch_size is not None:
            raise ValueError(
                "job.batches(loader, ...): the loader's job.sampler() sets the batch "
                "size; leave batch_size out"
            )
        return LoaderFeed(data, sampler, accumulate)
    if callable(getattr(data, "state_dict", None)) and callable(
        getattr(data, "load_state_dict", None)
    ):
        positions = DataPositions()
        tracked[POSITIONS] = positions
        return StatefulFeed(data, positions, seed, accumulate)
    if isinstance(data, torch.utils.data.DataLoader):
        raise AgentError(
            "job.batches cannot know which batch of a plain DataLoader belongs to a step: "
            "build it with batch_sampler=job.sampler(dataset, batch_size), or use "
            "torchdata's StatefulDataLoader, whose position moves with the rank"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(
            f"job.batches(dataset, batch_size, max_steps) needs a positive batch_size, "
            f"got {batch_size!r}"
        )
    return MapFeed(
        data,
        batch_size,
        seed=seed,
        shuffle=shuffle,
        collate_fn=collate_fn,
        accumulate=accumulate,
    )
