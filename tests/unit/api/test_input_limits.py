"""The API's input limits as pure rules: the body limit (an ASGI middleware), timestamps
that must be written as date-times within range, billing periods and cursors."""

from __future__ import annotations

import json
import re
from collections.abc import MutableMapping
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from services.api.limits import BodyLimit, declared_length
from services.api.models import (
    CURSOR_PATTERN,
    SPARE_CURSOR_PATTERN,
    ContractRequest,
    Period,
    Timestamp,
)
from services.api.settings import DEFAULT_MAX_BODY_BYTES, ApiSettings

LIMIT = 1024


class Recorder:
    """An ASGI app that reads the whole body, then answers 200 with its length."""

    def __init__(self) -> None:
        self.called = False
        self.received: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.called = True
        size = 0
        while True:
            message = await receive()
            self.received.append(message)
            if message["type"] == "http.disconnect":
                await send({"type": "http.response.start", "status": 400, "headers": []})
                await send({"type": "http.response.body", "body": b"disconnected"})
                return
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(size).encode()})


def _scope(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/v1/contracts", "headers": headers}


async def _run(
    headers: list[tuple[bytes, bytes]], chunks: list[bytes]
) -> tuple[Recorder, list[dict[str, Any]], int]:
    """Run ``BodyLimit`` over ``Recorder``; returns the app, what was sent, and how many
    body chunks the client had to deliver."""
    app = Recorder()
    pending = list(chunks)
    delivered = 0

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not pending:
            return {"type": "http.disconnect"}
        delivered += 1
        return {"type": "http.request", "body": pending.pop(0), "more_body": bool(pending)}

    sent: list[dict[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    await BodyLimit(app, lambda: LIMIT)(_scope(headers), receive, send)
    return app, sent, delivered


def _problem(sent: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    assert sent[0]["type"] == "http.response.start"
    assert (b"content-type", b"application/problem+json") in sent[0]["headers"]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return int(sent[0]["status"]), json.loads(body)


async def test_a_content_length_over_the_limit_is_413_before_one_byte_is_read() -> None:
    big = 50 * 1024 * 1024
    app, sent, delivered = await _run([(b"content-length", str(big).encode())], [b"x"] * 4)
    status, doc = _problem(sent)
    assert status == 413
    assert doc["field"] == "body"
    assert doc["title"] == "Content Too Large"
    assert f"{big} bytes" in doc["detail"]
    assert f"at most {LIMIT} bytes" in doc["detail"]
    assert "TORCHRELAY_API_MAX_BODY_BYTES" in doc["detail"]
    assert doc["instance"] == "/v1/contracts"
    assert delivered == 0, "the body was read"
    assert not app.called, "the app (and its token check) ran"


async def test_a_chunked_body_is_counted_and_refused_once_over_the_limit() -> None:
    chunks = [b"x" * 512] * 100  # 50 KiB in all, no Content-Length
    app, sent, delivered = await _run([(b"transfer-encoding", b"chunked")], chunks)
    status, doc = _problem(sent)
    assert status == 413
    assert doc["field"] == "body"
    assert "over the limit" in doc["detail"]
    assert "TORCHRELAY_API_MAX_BODY_BYTES" in doc["detail"]
    assert delivered == 3, "reading went on past the limit"
    # The app saw the client go away, and its own answer to that was not sent.
    assert app.received[-1] == {"type": "http.disconnect"}
    assert [m for m in sent if m.get("status") == 400] == []
    assert len(sent) == 2


@pytest.mark.parametrize(
    ("headers", "chunks"),
    [
        ([(b"content-length", str(LIMIT).encode())], [b"x" * 512, b"x" * 512]),
        ([(b"transfer-encoding", b"chunked")], [b"x" * 512, b"x" * 512]),
        ([], [b""]),
    ],
    ids=["content-length at the limit", "chunked at the limit", "no body"],
)
async def test_a_body_within_the_limit_reaches_the_app(
    headers: list[tuple[bytes, bytes]], chunks: list[bytes]
) -> None:
    app, sent, _ = await _run(headers, chunks)
    assert app.called
    assert sent[0]["status"] == 200
    assert sent[1]["body"] == str(sum(map(len, chunks))).encode()


def test_declared_length_takes_the_largest_number() -> None:
    assert declared_length([]) is None
    assert declared_length([(b"Content-Length", b"12")]) == 12
    assert declared_length([(b"content-length", b"3"), (b"content-length", b"99")]) == 99
    assert declared_length([(b"content-length", b"-1")]) is None


def test_the_limit_is_a_setting_with_a_one_mib_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DEFAULT_MAX_BODY_BYTES == 1024 * 1024
    assert ApiSettings().max_body_bytes == DEFAULT_MAX_BODY_BYTES
    monkeypatch.setenv("TORCHRELAY_API_MAX_BODY_BYTES", "65536")
    assert ApiSettings().max_body_bytes == 65536
    monkeypatch.setenv("TORCHRELAY_API_MAX_BODY_BYTES", "12")
    with pytest.raises(ValidationError, match="TORCHRELAY_API_MAX_BODY_BYTES"):
        ApiSettings()


# --------------------------------------------------------------------------- timestamps

TIMESTAMP: TypeAdapter[Any] = TypeAdapter(Timestamp)
PERIOD: TypeAdapter[str] = TypeAdapter(Period)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (1700000000, "numbers (Unix times) are refused"),
        (1.5, "numbers (Unix times) are refused"),
        (True, "numbers (Unix times) are refused"),
        ("1700000000", "numbers (Unix times) are refused"),
        ("9999-12-31T23:00:00-05:00", "out of range"),
        ("9999-12-31T23:59:59Z", "out of range"),
        ("0001-01-01T00:00:00+05:00", "out of range"),
        ("1969-12-31T23:59:59Z", "out of range"),
        ("2026-01-01T00:00:00", "timezone"),
    ],
)
def test_a_timestamp_is_a_date_time_within_range(value: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        TIMESTAMP.validate_python(value)


def test_a_timestamp_in_range_is_taken_as_written() -> None:
    for text in ("2026-01-01T00:00:00Z", "9998-12-31T23:59:59+00:00", "1970-01-01T01:00:00+01:00"):
        assert TIMESTAMP.validate_python(text).tzinfo is not None


def test_a_contract_refuses_a_number_as_its_term() -> None:
    body = {
        "tenant": "acme",
        "term_start": 1767225600,
        "term_end": "2027-01-01T00:00:00Z",
        "renewal_fee_minor": 1,
        "currency": "USD",
    }
    with pytest.raises(ValidationError) as err:
        ContractRequest.model_validate(body)
    assert err.value.errors()[0]["loc"] == ("term_start",)
    assert "numbers (Unix times) are refused" in str(err.value)


@pytest.mark.parametrize("period", ["0000-01", "9999-12", "1969-12"])
def test_a_period_outside_the_years_services_compute_is_refused(period: str) -> None:
    with pytest.raises(ValidationError, match=f"year {period[:4]} is out of range"):
        PERIOD.validate_python(period)


def test_periods_inside_the_range_and_their_shape() -> None:
    assert PERIOD.validate_python("1970-01") == "1970-01"
    assert PERIOD.validate_python("9998-12") == "9998-12"
    with pytest.raises(ValidationError, match="pattern"):
        PERIOD.validate_python("2026-13")


# --------------------------------------------------------------------------- cursors


def test_cursor_patterns_are_what_the_services_take() -> None:
    offset, slot = re.compile(CURSOR_PATTERN), re.compile(SPARE_CURSOR_PATTERN)
    # scheduler and billing: ^[0-9]+$ (an offset; nine digits bound it here)
    for good in ("0", "50", "999999999"):
        assert offset.match(good)
    for bad in ("", "zz", "-1", "1.5", "1" * 10, "a" * 256, "MTA=", "٣"):
        assert not offset.match(bad), bad
    # spare pool: the last slot_id of the page (its slot_id rule)
    assert slot.match("local:spare-1:0")
    assert slot.match("50")
    assert not slot.match("a b")
    assert not slot.match("x" * 257)


# --------------------------------------------------------------------------- the OpenAPI document


def _params(doc: dict[str, Any], path: str, method: str = "get") -> dict[str, Any]:
    return {p["name"]: p for p in doc["paths"][path][method].get("parameters", [])}


def _string_schema(param: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = param["schema"]
    return next(s for s in schema.get("anyOf", [schema]) if s.get("type") == "string")


def test_openapi_says_what_the_services_accept() -> None:
    from services.api.app import openapi_document

    doc = openapi_document()
    assert "TORCHRELAY_API_MAX_BODY_BYTES" in doc["info"]["description"]
    for path in ("/v1/jobs", "/v1/incidents", "/v1/contracts", "/v1/nodes", "/v1/tokens"):
        cursor = _string_schema(_params(doc, path)["cursor"])
        assert cursor["pattern"] == CURSOR_PATTERN == r"^[0-9]{1,9}$", path
    assert _string_schema(_params(doc, "/v1/spares")["cursor"])["pattern"] == SPARE_CURSOR_PATTERN
    for path, name in (
        ("/v1/incidents", "from"),
        ("/v1/incidents", "to"),
        ("/v1/contracts/{contract_id}/guarantee", "at"),
    ):
        param = _params(doc, path)[name]
        assert _string_schema(param)["format"] == "date-time", name
        assert "numbers (Unix times) are refused" in param["description"], name
        assert "9998-12-31T23:59:59Z" in param["description"], name
    period = _params(doc, "/v1/billing/export")["period"]
    assert period["schema"]["pattern"] == r"^[0-9]{4}-(0[1-9]|1[0-2])$"
    assert "1970 to 9998" in period["description"]
    term = doc["components"]["schemas"]["ContractRequest"]["properties"]["term_start"]
    assert term["format"] == "date-time"
    assert "numbers (Unix times) are refused" in term["description"]
    for path, method in (
        ("/v1/nodes/{node}/drain", "post"),
        ("/v1/contracts", "post"),
        ("/v1/tokens", "post"),
        ("/v1/billing/export", "get"),
        ("/v1/contracts/{contract_id}/guarantee", "get"),
    ):
        responses = doc["paths"][path][method]["responses"]
        for status in ("404", "413", "422"):
            assert "application/problem+json" in responses[status]["content"], (path, status)
        assert "TORCHRELAY_API_MAX_BODY_BYTES" in responses["413"]["description"]
    drain = doc["paths"]["/v1/nodes/{node}/drain"]["post"]["responses"]
    assert "known to the detector" in drain["404"]["description"]
    export = doc["paths"]["/v1/billing/export"]["get"]["responses"]
    assert "1970 to 9998" in export["422"]["description"]
    guarantee = doc["paths"]["/v1/contracts/{contract_id}/guarantee"]["get"]["responses"]
    assert "`at`" in guarantee["422"]["description"]
