"""The feeds of job.batches: the micro-batches of (step, rank) whoever holds the rank."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, get_worker_info

from torchrelay.agent._data import StepBatchSampler, StepSampler
from torchrelay.agent._errors import AgentError
from torchrelay.agent._feed import DataPositions, LoaderFeed, MapFeed, StatefulFeed, make_feed

STOP = 6


def dataset() -> TensorDataset:
    return TensorDataset(torch.arange(50).float().reshape(50, 1))


def loader(data: TensorDataset, workers: int = 2) -> DataLoader[Any]:
    return DataLoader(
        data,
        batch_sampler=StepBatchSampler(data, 4, seed=5),
        num_workers=workers,
        pin_memory=False,
        prefetch_factor=2 if workers else None,
        persistent_workers=bool(workers),
    )


def draw(feed: Any, step: int, rank: int, world: int = 2) -> list[list[float]]:
    feed.prepare(step, STOP, rank, world)
    return [b[0].reshape(-1).tolist() for b in feed.draw(step, rank)]


def test_a_loader_on_the_step_sampler_reads_what_the_step_sampler_says() -> None:
    data = dataset()
    order = StepSampler(50, 4, 2, seed=5, accumulate=3)
    feed = LoaderFeed(dl := loader(data), dl.batch_sampler, 3)  # type: ignore[arg-type]
    for step in range(4):
        want = [[float(i) for i in order.indices(step, 1, m)] for m in range(3)]
        assert draw(feed, step, 1) == want
    # A map-style dataset batched here reads the same.
    mapped = MapFeed(data, 4, seed=5, shuffle=True, collate_fn=None, accumulate=3)
    assert draw(mapped, 2, 1) == [[float(i) for i in order.indices(2, 1, m)] for m in range(3)]


def test_a_new_holder_and_a_repeated_step_read_what_the_first_holder_read() -> None:
    data = dataset()
    first = LoaderFeed(dl := loader(data), dl.batch_sampler, 2)  # type: ignore[arg-type]
    seen = {step: draw(first, step, 0) for step in range(4)}
    # The step that did not commit is read again from a loader already past it.
    assert draw(first, 3, 0) == seen[3]
    # A spare with its own loader takes the rank at step 2, without workers.
    spare = LoaderFeed(dl := loader(data, workers=0), dl.batch_sampler, 2)  # type: ignore[arg-type]
    assert [draw(spare, s, 0) for s in (2, 3)] == [seen[2], seen[3]]


def test_a_step_left_half_drawn_is_drawn_again_from_its_first_micro_batch() -> None:
    data = dataset()
    feed = LoaderFeed(dl := loader(data), dl.batch_sampler, 3)  # type: ignore[arg-type]
    other = LoaderFeed(dl := loader(data), dl.batch_sampler, 3)  # type: ignore[arg-type]
    draw(feed, 0, 1)
    feed.prepare(1, STOP, 1, 2)
    next(feed.draw(1, 1))  # the loop broke out after one micro-batch
    assert draw(feed, 1, 1) == draw(other, 1, 1)


class Stream(IterableDataset[torch.Tensor]):
    """Rank-sharded, worker-sharded, and it knows its position (what a resume needs)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.next: int | None = None

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        i = self.next if self.next is not None else worker
        while True:
            sample = torch.tensor([1000.0 * self.rank + i])
            self.next = i = i + workers
            yield sample

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next = state["next"]


class Replayed(IterableDataset[torch.Tensor]):
    """A stream without state_dict: torchdata would replay it to resume."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from (torch.tensor([float(i)]) for i in range(100))


def stream_feed(rank: int, positions: DataPositions, accumulate: int = 2) -> StatefulFeed:
    from torchdata.stateful_dataloader import StatefulDataLoader

    dl = StatefulDataLoader(Stream(rank), batch_size=3, num_workers=2)
    return StatefulFeed(dl, positions, seed=0, accumulate=accumulate)


def test_a_stream_resumes_at_the_committed_position_of_the_rank_on_another_loader() -> None:
    pytest.importorskip("torchdata")
    table = DataPositions()
    first = stream_feed(1, table)
    seen, after = {}, {}
    for step in range(4):
        seen[step] = draw(first, step, 1)
        assert first.drawn is not None
        after[step] = first.drawn
        first.committed(step, [b"rank 0's", after[step]])
    assert seen[0] != seen[1]
    # A repeated step (it did not commit): the table is at step 3, the loader past it.
    table.load_state_dict({"step": 2, "states": [b"rank 0's", after[2]]})
    assert draw(first, 3, 1) == seen[3]
    # A spare takes rank 1 at step 3 with the table it received, and reports the position
    # the first holder did: a second migration resumes where a first holder would.
    received = DataPositions()
    received.load_state_dict({"step": 2, "states": [b"rank 0's", after[2]]})
    spare = stream_feed(1, received)
    assert draw(spare, 3, 1) == seen[3]
    assert spare.drawn == after[3]


def test_a_stream_refuses_a_rank_change_and_a_table_of_another_step() -> None:
    pytest.importorskip("torchdata")
    feed = stream_feed(0, DataPositions())
    draw(feed, 0, 0)
    with pytest.raises(AgentError, match="rank changed from 0 to 1"):
        feed.prepare(1, STOP, 1, 2)
    fresh = stream_feed(0, DataPositions())
    with pytest.raises(AgentError, match="no loader position of rank 0 after step 4"):
        fresh.prepare(5, STOP, 0, 2)


def test_a_stream_that_cannot_say_its_position_is_refused() -> None:
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    with pytest.raises(AgentError, match="Replayed is an IterableDataset without state_dict"):
        StatefulFeed(StatefulDataLoader(Replayed(), batch_size=2), DataPositions(), 0, 1)


def feed_for(data: Any, batch_size: int | None = None, accumulate: int = 1) -> Any:
    return make_feed(data, batch_size, 0, True, None, accumulate, {})


def test_what_job_batches_cannot_step_index_is_refused_with_what_to_do() -> None:
    data = dataset()
    with pytest.raises(AgentError, match=r"batch_sampler=job\.sampler\(dataset, batch_size\)"):
        feed_for(DataLoader(data, batch_size=4, shuffle=True))
    with pytest.raises(ValueError, match="sets the batch size; leave batch_size out"):
        feed_for(loader(data, workers=0), batch_size=4)
    with pytest.raises(ValueError, match="accumulate must be a whole number >= 1, got 0"):
        feed_for(data, 4, accumulate=0)
    with pytest.raises(ValueError, match="needs a positive batch_size, got None"):
        feed_for(data)
    with pytest.raises(TypeError, match="map-style dataset with __len__"):
        feed_for(iter([1, 2]), 4)
