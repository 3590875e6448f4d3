"""Settings name the variable that is wrong."""

from __future__ import annotations

import pytest

from torchrelay.settings import ServiceSettings, SettingsError, load_settings


def test_malformed_urls_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "http://nope")
    with pytest.raises(SettingsError, match="REDIS_URL"):
        load_settings(ServiceSettings)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("NATS_URL", "nats//missing-colon")
    with pytest.raises(SettingsError, match="NATS_URL"):
        load_settings(ServiceSettings)


def test_prefixed_settings_and_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_URL", "nats://a:1,nats://b:2")
    monkeypatch.setenv("TORCHRELAY_CLUSTER", "west")
    monkeypatch.setenv("TORCHRELAY_HTTP_PORT", "8080")
    s = load_settings(ServiceSettings)
    assert s.nats_url == "nats://a:1,nats://b:2"
    assert s.cluster == "west"
    assert s.http_port == 8080
    monkeypatch.setenv("TORCHRELAY_HTTP_PORT", "eighty")
    with pytest.raises(SettingsError, match="TORCHRELAY_HTTP_PORT"):
        load_settings(ServiceSettings)
