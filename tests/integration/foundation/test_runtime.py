"""The embedded servers are the real binaries with production durability."""

from __future__ import annotations

from pathlib import Path

import redis

from torchrelay.runtime import start_servers


def test_embedded_servers_start_durable_and_stop(tmp_path: Path) -> None:
    servers = start_servers(tmp_path)
    try:
        assert servers.nats is not None
        assert servers.redis is not None
        client = redis.Redis.from_url(servers.redis_url)
        assert client.config_get("appendonly") == {b"appendonly": b"yes"} or client.config_get(
            "appendonly"
        ) == {"appendonly": "yes"}
        fsync = client.config_get("appendfsync")
        assert next(iter(fsync.values())) in (b"always", "always")
        client.set("k", "v")
        client.close()
        conf = (tmp_path / "nats" / "nats.conf").read_text()
        assert "sync_interval: always" in conf
        assert str(tmp_path) in conf  # JetStream store lives under the state dir
    finally:
        servers.stop()
    assert not servers.nats.alive()
    assert not servers.redis.alive()
    # Redis' AOF survives the restart.
    again = start_servers(tmp_path)
    try:
        client = redis.Redis.from_url(again.redis_url)
        assert client.get("k") == b"v"
        client.close()
    finally:
        again.stop()


def test_external_urls_skip_the_embedded_servers(tmp_path: Path) -> None:
    servers = start_servers(
        tmp_path, nats_url="nats://10.0.0.1:4222", redis_url="redis://10.0.0.1:6379/0"
    )
    assert servers.nats is None
    assert servers.redis is None
    assert servers.nats_url == "nats://10.0.0.1:4222"
