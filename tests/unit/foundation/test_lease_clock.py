"""The leader lease's local deadline: the pure rule (torchrelay.leadership.LeaseClock)."""

from __future__ import annotations

import pytest

from torchrelay.leadership import LeaseClock


def test_a_grant_holds_locally_for_less_than_its_ttl() -> None:
    clock = LeaseClock(ttl_s=2.0, drift=0.1)
    # The server's expiry is at least sent_at + ttl; the local deadline is before that.
    assert clock.valid_until(100.0) == pytest.approx(101.8)
    assert clock.valid_until(100.0) < 100.0 + clock.ttl_s
    assert clock.renew_every_s == 0.5
    assert clock.ttl_ms == 2000


@pytest.mark.parametrize(("ttl", "drift"), [(0.0, 0.1), (120.0, 0.1), (2.0, 0.5), (2.0, -0.1)])
def test_bad_settings_are_refused_naming_them(ttl: float, drift: float) -> None:
    with pytest.raises(ValueError, match=r"TTL|drift"):
        LeaseClock(ttl_s=ttl, drift=drift)
