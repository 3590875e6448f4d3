"""Fixtures of the API's tests: canned responders on real NATS, the app on real Redis."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
from starlette.exceptions import StarletteDeprecationWarning

with warnings.catch_warnings():
    # Starlette 1.x asks for httpx2 behind its TestClient; httpx (a runtime dependency)
    # still works and is what the CLI uses, so one HTTP client is enough.
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

from services.api.app import create_app
from services.api.settings import ApiSettings
from tests.unit.api.canned import OPERATOR_TOKEN, BackgroundLoop, CannedServices


@pytest.fixture
def background() -> Iterator[BackgroundLoop]:
    loop = BackgroundLoop()
    yield loop
    loop.close()


@pytest.fixture
def canned(background: BackgroundLoop, nats_url: str) -> Iterator[CannedServices]:
    """Every service verb the API asks, answered from canned data over real NATS."""
    services = CannedServices()
    background.run(services.start(nats_url))
    yield services
    background.run(services.stop())


@pytest.fixture
def api_settings(nats_url: str, redis_url: str) -> ApiSettings:
    return ApiSettings(
        nats_url=nats_url,
        redis_url=redis_url,
        environment="test",
        operator_token=OPERATOR_TOKEN,
        rpc_timeout_s=2.0,
        log_json=False,
    )


@pytest.fixture
def client(api_settings: ApiSettings, canned: CannedServices) -> Iterator[TestClient]:
    """The API app (lifespan run: connected to NATS and Redis) in FastAPI's TestClient."""
    with TestClient(create_app(api_settings)) as c:
        yield c


@pytest.fixture
def operator() -> dict[str, str]:
    return {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


def tenant_token(client: TestClient, tenant: str) -> dict[str, str]:
    """Headers with a new tenant token for ``tenant``, issued by the operator."""
    r = client.post(
        "/v1/tokens",
        json={"scope": "tenant", "tenant": tenant},
        headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"},
    )
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


@pytest.fixture
def acme(client: TestClient) -> dict[str, str]:
    return tenant_token(client, "acme")


@pytest.fixture
def globex(client: TestClient) -> dict[str, str]:
    return tenant_token(client, "globex")
