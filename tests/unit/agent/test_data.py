"""Step-indexed data: what a rank reads at a step depends only on (seed, step, rank)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrelay.agent._data import StepSampler, derive_seed, make_batch, seed_step


def test_seeds_are_stable_and_distinct() -> None:
    assert derive_seed(0, 1, 2) == derive_seed(0, 1, 2)
    assert len({derive_seed(7, s, r) for s in range(20) for r in range(4)}) == 80


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 200),
    bs=st.integers(1, 16),
    ws=st.integers(1, 6),
    step=st.integers(0, 300),
    seed=st.integers(0, 5),
    shuffle=st.booleans(),
)
def test_a_replacement_reads_what_the_lost_rank_would_have(
    n: int, bs: int, ws: int, step: int, seed: int, shuffle: bool
) -> None:
    lived = StepSampler(n, bs, ws, seed=seed, shuffle=shuffle)
    for s in range(0, step, 37):  # the original rank had walked through earlier steps
        lived.indices(s, 0)
    fresh = StepSampler(n, bs, ws, seed=seed, shuffle=shuffle)
    for rank in range(ws):
        assert fresh.indices(step, rank) == lived.indices(step, rank)


def test_one_epoch_is_split_without_overlap() -> None:
    sampler = StepSampler(48, 4, 3, seed=1)
    seen = [i for step in range(4) for rank in range(3) for i in sampler.indices(step, rank)]
    assert sorted(seen) == list(range(48))
    assert seen != list(range(48))  # shuffled


def test_step_seeding_reproduces_dropout() -> None:
    drop = torch.nn.Dropout(0.5)
    seed_step(3, 10, 1)
    a = drop(torch.ones(64))
    seed_step(3, 11, 1)
    b = drop(torch.ones(64))
    seed_step(3, 10, 1)
    assert torch.equal(drop(torch.ones(64)), a)
    assert not torch.equal(a, b)


def test_step_seeding_without_an_accelerator_matches_torch_manual_seed() -> None:
    seed_step(5, 7, 2)
    ours = torch.rand(8)
    torch.manual_seed(derive_seed(5, 7, 2))
    assert torch.equal(torch.rand(8), ours)


def test_batches_are_collated() -> None:
    data = [(torch.tensor([float(i)]), i) for i in range(10)]
    x, y = make_batch(data, [3, 5], None)
    assert x.shape == (2, 1)
    assert y.tolist() == [3, 5]
    assert make_batch(data, [1], lambda items: len(items)) == 1
