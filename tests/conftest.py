"""Fixtures: real nats-server and redis-server processes on free ports (no fakes).

With ``TORCHRELAY_TEST_INFRA=containers`` and a Docker engine, the same fixtures start
the servers with testcontainers instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from torchrelay.bus import Bus
from torchrelay.contract import GENERATIONS_BUCKET
from torchrelay.runtime import ServerProcess, nats_server, redis_server


def _containers_wanted() -> bool:
    return os.environ.get("TORCHRELAY_TEST_INFRA") == "containers" and bool(shutil.which("docker"))


@pytest.fixture(scope="session")
def nats_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A real nats-server with JetStream (file store) for the whole session."""
    if _containers_wanted():  # pragma: no cover - needs a Docker engine
        from testcontainers.nats import NatsContainer  # type: ignore[import-not-found]

        with NatsContainer(command="-js") as c:
            url = c.nats_uri()
            host, port = url.rsplit("//", 1)[1].split(":")
            yield ServerProcess("nats", url, host, int(port), Path("."), [], Path("/dev/null"))
        return
    server = nats_server(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A real redis-server (AOF always) for the whole session."""
    if _containers_wanted():  # pragma: no cover - needs a Docker engine
        from testcontainers.redis import RedisContainer  # type: ignore[import-not-found]

        with RedisContainer() as c:
            host, port = c.get_container_host_ip(), int(c.get_exposed_port(6379))
            yield ServerProcess(
                "redis", f"redis://{host}:{port}/0", host, port, Path("."), [], Path("/dev/null")
            )
        return
    server = redis_server(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_proc: ServerProcess) -> str:
    return nats_proc.url


@pytest.fixture
def redis_url(redis_proc: ServerProcess) -> str:
    return redis_proc.url


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client on a flushed database."""
    client = aioredis.from_url(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    """A bus connection with the streams provisioned and cleared of earlier tests' events
    and generations (a test's job ids are then its own, like its Redis keys)."""
    b = await Bus.connect(nats_url, "test")
    await b.provision_streams()
    await b.generations()  # the bucket exists before its stream is purged
    for stream in ("TR_EVENTS", "TR_DLQ", f"KV_{GENERATIONS_BUCKET}"):
        await b.js.purge_stream(stream)
    yield b
    await b.close()


@pytest.fixture
def fresh_nats(tmp_path: Path) -> Iterator[ServerProcess]:
    """A nats-server of this test alone (tests that restart or kill it)."""
    server = nats_server(tmp_path / "state")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def fresh_redis(tmp_path: Path) -> Iterator[ServerProcess]:
    """A redis-server of this test alone (tests that kill and restart it on its AOF)."""
    server = redis_server(tmp_path / "state")
    server.start()
    yield server
    server.stop()
