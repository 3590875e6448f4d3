"""The hosts' network helper names the ``ip`` command that failed and why."""

from __future__ import annotations

import shutil

import pytest

from torchrelay import netns


@pytest.mark.skipif(shutil.which("ip") is None, reason="the ip command (iproute2) is missing")
def test_a_failed_ip_command_is_named_with_its_error() -> None:
    with pytest.raises(netns.NetworkError, match=r"^ip link del tr-no-such-link failed: \S"):
        netns._ip("link", "del", "tr-no-such-link")
    assert netns._ip("link", "del", "tr-no-such-link", check=False).returncode != 0
