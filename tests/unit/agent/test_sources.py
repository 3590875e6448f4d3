"""Who sends the state to whom after a generation's step agreement."""

from __future__ import annotations

from torchrelay.agent._agree import NO_STATE, state_sources


def test_a_spare_takes_the_state_from_its_ring_predecessor() -> None:
    assert state_sources([49, 49, NO_STATE, 49]) == {2: 1}


def test_the_predecessor_is_searched_backwards_around_the_ring() -> None:
    assert state_sources([NO_STATE, 49, 49, 49]) == {0: 3}
    assert state_sources([NO_STATE, NO_STATE, 49, 49]) == {0: 3, 1: 3}


def test_two_receivers_are_served_by_two_senders() -> None:
    assert state_sources([49, NO_STATE, 49, NO_STATE]) == {1: 0, 3: 2}


def test_a_rank_one_step_behind_receives_and_nobody_sends_when_all_agree() -> None:
    assert state_sources([50, 49, 50, 50]) == {1: 0}
    assert state_sources([50, 50, 50, 50]) == {}
