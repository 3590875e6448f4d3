"""Step-indexed data: the batch and the random seeds of (step, rank) are pure functions.

A rank that takes over at step ``s`` must read exactly the samples, and draw exactly the
dropout masks, that the rank it replaces would have. So nothing here depends on history:
the global sample order of an epoch is a permutation seeded by (seed, epoch), and
micro-batch ``m`` of step ``s`` of rank ``r`` reads the ``r``-th slice of window
``s * accumulate + m`` of that order.
"""

from __future__ import annotations

import functools
import hashlib
import random
import sys
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes, Python versions and machines)."""
    raw = ",".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "big") & ((1 << 63) - 1)


@functools.cache
def _has_accelerator() -> bool:
    """Whether torch sees an accelerator (CUDA, XPU, MPS, ...) in this process."""
    try:
        return bool(torch.accelerator.is_available())
    except Exception:
        return True  # unknown: seed everything, as torch.manual_seed does


def seed_step(seed: int, step: int, rank: int) -> None:
    """Seed torch (CPU and CUDA), ``random`` and, if loaded, numpy for (seed, step, rank)."""
    value = derive_seed(seed, step, rank)
    if _has_accelerator():
        torch.manual_seed(value)
    else:
        # What torch.manual_seed does on a host without an accelerator, without its lazy
        # seeding of CUDA/XPU/MTIA, which formats the caller's stack three times per call
        # (~2 ms a step on a loaded 2-core host).
        torch.default_generator.manual_seed(value)
    random.seed(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value % (1 << 32))


class StepSampler:
    """The sample indices of (step, rank) for a dataset of ``length`` samples.

    Each micro-batch consumes ``world_size * batch_size`` samples of the epoch order, each
    step ``accumulate`` of them; an epoch boundary may fall inside a step (the window wraps
    into the next epoch's order).
    """

    def __init__(
        self,
        length: int,
        batch_size: int,
        world_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        accumulate: int = 1,
    ) -> None:
        if length <= 0:
            raise ValueError("the dataset is empty: job.batches needs at least one sample")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if accumulate <= 0:
            raise ValueError(f"accumulate must be at least 1, got {accumulate}")
        self.length = length
        self.batch_size = batch_size
        self.world_size = world_size
        self.accumulate = accumulate
        self.seed = seed
        self.shuffle = shuffle
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            if self.shuffle:
                gen = torch.Generator().manual_seed(derive_seed(self.seed, epoch, -1))
                order = torch.randperm(self.length, generator=gen).tolist()
            else:
                order = list(range(self.length))
            if len(self._orders) > 2:  # steps move forward; keep the current epoch or two
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return order

    def indices(self, step: int, rank: int, micro: int = 0) -> list[int]:
        """The dataset indices rank ``rank`` reads in micro-batch ``micro`` of ``step``."""
        window = step * self.accumulate + micro
        start = (window * self.world_size + rank) * self.batch_size
        out = []
        for offset in range(start, start + self.batch_size):
            epoch, pos = divmod(offset, self.length)
            out.append(self._order(epoch)[pos])
        return out


class StepBatchSampler:
    """A ``batch_sampler`` for :class:`torch.utils.data.DataLoader` that yields the
    micro-batches of (step, rank) from the step the job is at (make it with
    ``job.sampler(dataset, batch_size)``).

    ``job.batches(loader, max_steps)`` moves it: before each iterator it is set to the
    step, rank and world size to read from, so a loader with workers, ``pin_memory`` and
    prefetching yields what :class:`StepSampler` says whoever holds the rank.
    """

    def __init__(
        self, dataset: Any, batch_size: int, *, seed: int = 0, shuffle: bool = True
    ) -> None:
        self.length = dataset_length(dataset)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._order = StepSampler(self.length, batch_size, 1, seed=seed, shuffle=shuffle)
        self._start = 0
        self._stop = 0
        self._rank = 0

    def seek(self, step: int, stop: int, rank: int, world_size: int, accumulate: int) -> None:
        """Read steps ``step .. stop - 1`` of rank ``rank`` in a group of ``world_size``."""
        if (world_size, accumulate) != (self._order.world_size, self._order.accumulate):
            self._order = StepSampler(
                self.length,
                self.batch_size,
                world_size,
                seed=self.seed,
                shuffle=self.shuffle,
                accumulate=accumulate,
            )
        self._start, self._stop, self._rank = step, stop, rank

    def __iter__(self) -> Iterator[list[int]]:
        order, rank = self._order, self._rank
        for step in range(self._start, self._stop):
            for micro in range(order.accumulate):
                yield order.indices(step, rank, micro)

    def __len__(self) -> int:
        return max(0, self._stop - self._start) * self._order.accumulate


def make_batch(
    dataset: Any, indices: list[int], collate_fn: Callable[[list[Any]], Any] | None
) -> Any:
    """Collate ``dataset[i]`` for ``indices`` (torch's default collation unless given one)."""
    items = [dataset[i] for i in indices]
    if collate_fn is not None:
        return collate_fn(items)
    from torch.utils.data import default_collate

    return default_collate(items)


def dataset_length(dataset: Any) -> int:
    """``len(dataset)``, with an error that says what job.batches needs."""
    if not isinstance(dataset, Sized):
        raise TypeError("job.batches needs a map-style dataset with __len__ and __getitem__")
    return len(dataset)
