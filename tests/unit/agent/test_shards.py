"""Shard classes and who restores whose shard (pure rules of ``_shards``)."""

from __future__ import annotations

import torch

from torchrelay.agent._agree import NO_STATE
from torchrelay.agent._shards import shard_classes, shard_sources

HSDP = torch.arange(4).view(2, 2)  # (replicate, shard): ranks 0, 2 hold shard 0; 1, 3 shard 1


def test_a_replica_dimension_groups_ranks_that_hold_the_same_shard() -> None:
    assert shard_classes(HSDP, 0b01) == [0, 1, 0, 1]  # dim 0 replicates
    assert shard_classes(HSDP, 0b10) == [0, 0, 2, 2]  # dim 1 replicates (TP inside DP)
    assert shard_classes(HSDP, 0b00) == [0, 1, 2, 3]  # every rank its own shard
    assert shard_classes(HSDP, 0b11) == [0, 0, 0, 0]  # replicated data parallel


def test_classes_follow_the_meshs_layout_not_rank_order() -> None:
    # Ranks 3 and 2 share column 0 (class 2, its lowest rank), ranks 1 and 0 column 1.
    layout = torch.tensor([[3, 1], [2, 0]])
    assert shard_classes(layout, 0b01) == [0, 0, 2, 2]


def test_a_lost_rank_receives_from_the_lowest_holder_of_its_shard() -> None:
    plan = shard_sources([7, NO_STATE, 7, 7], [0, 1, 0, 1])
    assert plan.sources == {1: 3}
    assert plan.unrestorable == []


def test_a_rank_whose_whole_class_is_lost_is_unrestorable() -> None:
    plan = shard_sources([7, NO_STATE, 7, NO_STATE], [0, 1, 0, 1])
    assert plan.sources == {}
    assert plan.unrestorable == [1, 3]


def test_an_older_copy_in_the_class_does_not_count() -> None:
    plan = shard_sources([7, 6, 7, 7], [0, 1, 2, 3])  # pure FSDP: rank 1 is behind
    assert plan.unrestorable == [1]
