"""A real ``nats-server`` and ``redis-server`` started with the configuration ``torchrelay up``
generates (``torchrelay.auth.ensure_bundle``), JetStream provisioned as ``admin``, and the
scheduler's credential side (auth callout, job credentials) run as the service runs it."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis

from services.scheduler.credentials import REVOKER_ENV, setup_credentials
from torchrelay.auth import REVOKER, AuthBundle, JobCredentialStore, ensure_bundle
from torchrelay.bus import Bus
from torchrelay.observability import ServiceMetrics
from torchrelay.runtime import ServerProcess, nats_server, redis_server
from torchrelay.service import ServiceContext
from torchrelay.settings import ServiceSettings

# The secret a test launcher binds its jobs with (``JobCredentialsRequest.claim``).
CLAIM = "launcher-claim-0123456789"


@dataclass
class Servers:
    bundle: AuthBundle
    nats: ServerProcess
    redis: ServerProcess


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    state = tmp_path_factory.mktemp("auth")
    bundle = ensure_bundle(state / "auth")
    nats_proc = nats_server(state, extra_config=bundle.nats_authorization())
    redis_proc = redis_server(state, password=bundle.redis_password, aclfile=bundle.redis_acl_path)
    nats_proc.start()
    try:
        redis_proc.start()
        yield Servers(bundle, nats_proc, redis_proc)
    finally:
        redis_proc.stop()
        nats_proc.stop()


async def role_bus(servers: Servers, role: str) -> Bus:
    return await Bus.connect(
        servers.nats.url, f"test-{role}", credentials=str(servers.bundle.cred_path(role))
    )


@dataclass
class Plane:
    """The scheduler's credential side and the executor, connected with their own users."""

    scheduler: Bus
    executor: Bus
    redis: Any
    store: JobCredentialStore


@pytest.fixture
async def plane(servers: Servers) -> AsyncIterator[Plane]:
    admin = await role_bus(servers, "admin")
    try:
        await admin.provision()
    finally:
        await admin.close()
    executor = await role_bus(servers, "migration_executor")
    scheduler = await role_bus(servers, "scheduler")
    url = servers.bundle.redis_url("127.0.0.1", servers.redis.port, role="scheduler")
    client = aioredis.from_url(url)
    ctx = ServiceContext(
        "scheduler",
        ServiceSettings(nats_url=servers.nats.url),
        scheduler,
        client,
        ServiceMetrics("scheduler-auth-test"),
        logging.getLogger("test.scheduler"),
    )
    os.environ["TORCHRELAY_AUTH_ISSUER_SEED_FILE"] = str(servers.bundle.directory / "issuer.seed")
    os.environ[REVOKER_ENV] = str(servers.bundle.cred_path(REVOKER))
    try:
        await setup_credentials(ctx)
    finally:
        os.environ.pop("TORCHRELAY_AUTH_ISSUER_SEED_FILE", None)
        os.environ.pop(REVOKER_ENV, None)
    assert ctx.readiness["auth_callout"] == "on"
    try:
        yield Plane(scheduler, executor, client, JobCredentialStore(client, ctx.prefix))
    finally:
        for closer in ctx.closers:
            await closer()
        await scheduler.close()
        await executor.close()
        await client.aclose()


async def refused(bus: Bus, subject: str, timeout: float = 3.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = bus.refused(subject)
        if found:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"the server did not refuse {subject} (refusals: {bus.refusals})")
