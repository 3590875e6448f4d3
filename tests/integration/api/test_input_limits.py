"""The API's input limits against the real services: oversized bodies are refused unread
(413, before the token is checked), out-of-range periods and timestamps and numbers as
timestamps are 422 naming the parameter, unknown nodes are not drained (404), and cursors
are refused by the API when the services would refuse them.

The stack (real scheduler, billing, spare-pool and detector services on real NATS and Redis,
the API on uvicorn) is the one of ``test_real_services``.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.integration.api import test_real_services as real

pytestmark = pytest.mark.slow

# The same module-scoped fixtures, started once for this module.
stack = real.stack
world = real.world

MIB = 1024 * 1024


def _problem(r: httpx.Response, status: int, field: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    doc: dict[str, Any] = r.json()
    assert doc["status"] == status
    assert doc["field"] == field, doc
    return doc


def _raw_request(url: str, head: str, timeout_s: float = 5.0) -> tuple[int, dict[str, Any]]:
    """Send only ``head`` (request line and headers, no body) and read the answer."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s) as sock:
        sock.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"the connection closed before an answer: {data!r}"
            data += chunk
        header, _, body = data.partition(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        length = int(headers["content-length"])
        while len(body) < length:
            chunk = sock.recv(65536)
            assert chunk, "the connection closed in the middle of the answer"
            body += chunk
    assert headers["content-type"] == "application/problem+json"
    return int(lines[0].split()[1]), json.loads(body[:length])


# --------------------------------------------------------------------------- body limit


def test_a_50_mb_unauthenticated_body_is_413_before_it_is_sent(stack: real.Stack) -> None:
    big = 50 * MIB
    started = time.monotonic()
    # Only the headers go: the answer comes though not one byte of the body was sent, so
    # the API neither read nor waited for it (and did not check the missing token first).
    status, doc = _raw_request(
        stack.url,
        "POST /v1/contracts HTTP/1.1\r\nHost: api\r\nContent-Type: application/json\r\n"
        f"Content-Length: {big}\r\n\r\n",
    )
    assert status == 413
    assert doc["field"] == "body"
    assert f"{big} bytes" in doc["detail"]
    assert "TORCHRELAY_API_MAX_BODY_BYTES" in doc["detail"]
    assert time.monotonic() - started < 5
    assert httpx.get(f"{stack.url}/healthz", timeout=5).status_code == 200


def test_a_50_mb_body_sent_whole_is_413_too(stack: real.Stack) -> None:
    sent = 0

    def body() -> Iterator[bytes]:
        nonlocal sent
        for _ in range(50):
            sent += MIB
            yield b"x" * MIB

    r = httpx.post(
        f"{stack.url}/v1/contracts",
        content=body(),
        headers={"Content-Length": str(50 * MIB), "Content-Type": "application/json"},
        timeout=30,
    )
    doc = _problem(r, 413, "body")
    assert "at most 1048576 bytes" in doc["detail"]


def test_a_chunked_body_over_the_limit_is_413(stack: real.Stack) -> None:
    def body() -> Iterator[bytes]:
        for _ in range(64):
            yield b"x" * 32768  # 2 MiB in all, no Content-Length

    r = stack.op.post("/v1/contracts", content=body(), headers={"Content-Type": "application/json"})
    doc = _problem(r, 413, "body")
    assert "over the limit" in doc["detail"]
    assert "TORCHRELAY_API_MAX_BODY_BYTES" in doc["detail"]


def test_an_authenticated_post_within_the_limit_still_works(world: real.Stack) -> None:
    contract = {
        "contract_id": "ctr-limits",
        "tenant": "initech",
        "term_start": "2030-01-01T00:00:00Z",
        "term_end": "2031-01-01T00:00:00Z",
        "renewal_fee_minor": 1000,
        "currency": "USD",
    }
    r = world.op.post("/v1/contracts", json=contract)
    assert r.status_code == 201, r.text
    assert r.json()["contract_id"] == "ctr-limits"

    def chunked() -> Iterator[bytes]:
        yield json.dumps({"scope": "tenant", "tenant": "acme"}).encode()

    r = world.op.post("/v1/tokens", content=chunked(), headers={"Content-Type": "application/json"})
    assert r.status_code == 201, r.text
    assert r.json()["tenant"] == "acme"


# --------------------------------------------------------------------------- periods, times


@pytest.mark.parametrize("period", ["0000-01", "9999-12", "1969-12"])
def test_a_period_out_of_range_is_422_naming_it(world: real.Stack, period: str) -> None:
    r = world.op.get("/v1/billing/export", params={"period": period})
    doc = _problem(r, 422, "period")
    assert f"year {period[:4]} is out of range" in doc["detail"]
    assert "service" not in doc


def test_a_period_in_range_is_exported(world: real.Stack) -> None:
    r = world.op.get("/v1/billing/export", params={"period": "9998-12", "format": "json"})
    assert r.status_code == 200, r.text
    assert r.json() == []


@pytest.mark.parametrize(
    ("at", "message"),
    [
        ("9999-12-31T23:00:00-05:00", "out of range"),
        ("9999-12-31T23:59:59Z", "out of range"),
        ("1700000000", "numbers (Unix times) are refused"),
        ("0", "numbers (Unix times) are refused"),
    ],
)
def test_a_guarantee_at_out_of_range_or_a_number_is_422_naming_at(
    world: real.Stack, at: str, message: str
) -> None:
    r = world.op.get("/v1/contracts/ctr-a/guarantee", params={"at": at})
    doc = _problem(r, 422, "at")
    assert message in doc["detail"]


@pytest.mark.parametrize("name", ["from", "to"])
def test_incident_filters_refuse_numbers(world: real.Stack, name: str) -> None:
    r = world.op.get("/v1/incidents", params={name: "1700000000"})
    doc = _problem(r, 422, name)
    assert "numbers (Unix times) are refused" in doc["detail"]
    ok = world.op.get("/v1/incidents", params={name: "2026-01-01T00:00:00Z"})
    assert ok.status_code == 200, ok.text


def test_a_contract_with_a_number_as_its_term_is_422(world: real.Stack) -> None:
    r = world.op.post(
        "/v1/contracts",
        json={
            "tenant": "acme",
            "term_start": 1767225600,
            "term_end": "2027-01-01T00:00:00Z",
            "renewal_fee_minor": 1,
            "currency": "USD",
        },
    )
    doc = _problem(r, 422, "term_start")
    assert "numbers (Unix times) are refused" in doc["detail"]


# --------------------------------------------------------------------------- drain


def test_draining_an_unknown_node_is_404_and_a_known_one_202(world: real.Stack) -> None:
    r = world.op.post("/v1/nodes/node-nope/drain", json={"reason": "test"})
    doc = _problem(r, 404, "node")
    assert "node-nope" in doc["detail"]
    r = world.op.post("/v1/nodes/node-2/drain", json={"reason": "test"})
    assert r.status_code == 202, r.text
    assert r.json()["node"] == "node-2"


# --------------------------------------------------------------------------- cursors


@pytest.mark.parametrize(
    "path",
    [
        "/v1/jobs?cursor=abc",
        "/v1/incidents?cursor=MTA%3D",
        "/v1/contracts?cursor=1234567890",
        "/v1/nodes?cursor=-1",
        "/v1/spares?cursor=a%20b",
    ],
)
def test_a_cursor_the_services_would_refuse_is_422_from_the_api(
    world: real.Stack, path: str
) -> None:
    doc = _problem(world.op.get(path), 422, "cursor")
    assert "cursor" in doc["detail"]
    assert "service" not in doc  # refused by the API, not passed on


def test_cursors_the_services_return_are_taken(world: real.Stack) -> None:
    page = world.op.get("/v1/spares", params={"limit": 1}).json()
    assert page["next_cursor"] is not None
    r = world.op.get("/v1/spares", params={"limit": 1, "cursor": page["next_cursor"]})
    assert r.status_code == 200, r.text
    page = world.op.get("/v1/jobs", params={"limit": 1}).json()
    r = world.op.get("/v1/jobs", params={"limit": 1, "cursor": page["next_cursor"]})
    assert r.status_code == 200, r.text
    assert len(r.json()["items"]) == 1


def test_the_served_openapi_says_what_is_accepted(stack: real.Stack) -> None:
    doc = httpx.get(f"{stack.url}/openapi.json", timeout=5).json()
    jobs = {p["name"]: p for p in doc["paths"]["/v1/jobs"]["get"]["parameters"]}
    assert jobs["cursor"]["schema"]["anyOf"][0]["pattern"] == r"^[0-9]{1,9}$"
    drain = doc["paths"]["/v1/nodes/{node}/drain"]["post"]["responses"]
    assert set(drain) >= {"202", "404", "413", "422"}
    assert "TORCHRELAY_API_MAX_BODY_BYTES" in drain["413"]["description"]
