"""The agent's options refuse bad input with an error that names it and says what to give."""

from __future__ import annotations

import pytest

from torchrelay.agent._chaos import ChaosPoint
from torchrelay.agent._config import verify_every_setting
from torchrelay.agent._errors import AgentError


def test_verify_every_comes_from_the_option_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCHRELAY_VERIFY_EVERY", raising=False)
    assert verify_every_setting(None) == 0
    monkeypatch.setenv("TORCHRELAY_VERIFY_EVERY", "25")
    assert verify_every_setting(None) == 25
    assert verify_every_setting(3) == 3


@pytest.mark.parametrize("raw", ["every", "1.5", "-2"])
def test_a_bad_verify_every_is_named(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("TORCHRELAY_VERIFY_EVERY", raw)
    with pytest.raises(AgentError, match=r"N >= 1|whole number of steps >= 1"):
        verify_every_setting(None)


def test_a_bad_verify_every_option_is_named() -> None:
    with pytest.raises(AgentError, match=r"verify_every=True: give a whole number"):
        verify_every_setting(True)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("forward:j-w1:3", "POINT one of allreduce, send_state, recv_state"),
        ("allreduce:j-w1:x", "POINT:MEMBER:STEP"),
        ("allreduce:j-w1:3:TERM", "the signal must be KILL or STOP, not 'TERM'"),
    ],
)
def test_a_bad_chaos_point_is_named(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChaosPoint(spec, "j-w1")


def test_a_chaos_point_of_another_member_does_nothing_here() -> None:
    point = ChaosPoint("allreduce:j-w2:3:STOP", "j-w1")
    assert point.point is None
    point.hit("allreduce", 3)  # would stop this test process if it matched
