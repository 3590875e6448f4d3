"""The OpenAPI document: deterministic, in ``proto/``, and honoured by the running API.

schemathesis generates requests from the document (a bounded number per operation) and sends
them to a real uvicorn server with real-NATS responders behind it: no answer may be a 5xx, and
every answer must match the document (status, content type, schema).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from services.api.app import create_app, openapi_document
from services.api.settings import ApiSettings
from services.protogen import generate
from tests.unit.api.canned import OPERATOR_TOKEN, BackgroundLoop, CannedServices, ServerThread
from torchrelay.runtime import ServerProcess

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

ROOT = Path(__file__).resolve().parents[3]
INTERFACES_ROUTES = {
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
    ("post", "/v1/tokens"),
    ("get", "/v1/clusters"),
    ("get", "/v1/nodes"),
    ("get", "/v1/nodes/{node}"),
    ("post", "/v1/nodes/{node}/drain"),
    ("post", "/v1/nodes/{node}/return"),
    ("get", "/v1/spares"),
    ("post", "/v1/spares"),
    ("get", "/v1/jobs"),
    ("get", "/v1/jobs/{job_id}"),
    ("get", "/v1/jobs/{job_id}/timeline"),
    ("get", "/v1/incidents"),
    ("get", "/v1/incidents/{incident_id}"),
    ("post", "/v1/contracts"),
    ("get", "/v1/contracts"),
    ("get", "/v1/contracts/{contract_id}"),
    ("get", "/v1/contracts/{contract_id}/guarantee"),
    ("post", "/v1/contracts/{contract_id}/close-term"),
    ("get", "/v1/billing/export"),
}


def test_document_is_deterministic_and_lists_every_route() -> None:
    doc = openapi_document()
    assert json.dumps(doc, sort_keys=True) == json.dumps(openapi_document(), sort_keys=True)
    ops = {(m, p) for p, item in doc["paths"].items() for m in item}
    assert ops >= INTERFACES_ROUTES
    for path, item in doc["paths"].items():
        for op in item.values():
            if path.startswith("/v1/"):
                assert op["security"] == [{"bearer": []}], path
                for status in ("401", "403", "422", "503"):
                    assert "application/problem+json" in op["responses"][status]["content"]
    incident = doc["components"]["schemas"]["Incident"]["properties"]
    assert {"stall_ms", "lost_steps", "bytes_moved", "generation_after"} <= set(incident)


def test_proto_openapi_is_current() -> None:
    path = ROOT / "proto" / "openapi.json"
    assert path.exists(), "proto/openapi.json is missing; run `make proto`"
    assert path.read_text() == generate()["openapi.json"], "proto/ is stale; run `make proto`"


@pytest.fixture(scope="module")
def live_api(nats_proc: ServerProcess, redis_proc: ServerProcess) -> Iterator[str]:
    """A real uvicorn server with canned responders behind it, for the whole module."""
    loop = BackgroundLoop()
    services = CannedServices()
    loop.run(services.start(nats_proc.url))
    cfg = ApiSettings(
        nats_url=nats_proc.url,
        redis_url=redis_proc.url,
        environment="test",
        operator_token=OPERATOR_TOKEN,
        rpc_timeout_s=2.0,
        log_json=False,
    )
    server = ServerThread(loop, create_app(cfg))
    url = server.start()
    yield url
    server.stop()
    loop.run(services.stop())
    loop.close()


schema = schemathesis.openapi.from_dict(openapi_document())


@schema.parametrize()
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)
def test_api_honours_its_openapi_document(case: Any, live_api: str) -> None:
    case.call_and_validate(
        base_url=live_api,
        headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"},
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
        timeout=10,
    )
