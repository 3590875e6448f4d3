"""The billing service in-process on real NATS and Redis: events in, RPC and credits out."""

from __future__ import annotations

import asyncio
import csv
import io
import json
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import pytest
import redis.asyncio as aioredis
from nats.aio.msg import Msg

from services.billing.service import setup
from tests.helpers.inproc import service_settings, start_in_process
from torchrelay.bus import Bus, RpcFailed
from torchrelay.contract import (
    CreditIssued,
    DeadLetter,
    IncidentClosed,
    Resolution,
    Subjects,
    make_event_id,
    utcnow,
)

from .conftest import Q1_END, Q1_START, make_incident


@pytest.fixture
async def billing(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus
) -> AsyncIterator[None]:
    """The billing service running in this process until the test ends."""
    del redis, bus  # flushed Redis and purged streams before the service starts
    service = await start_in_process("billing", setup, service_settings(nats_url, redis_url))
    try:
        yield
    finally:
        await service.stopped(within_s=15)


async def rpc(bus: Bus, verb: str, body: dict[str, Any]) -> Any:
    return await bus.request(Subjects.rpc("billing", verb), body, timeout=10)


async def until(predicate: Any, what: str, timeout: float = 20.0) -> Any:
    """Poll an async predicate until it returns a truthy value, or fail naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.05)


def closed_event(
    incident_id: str, resolution: Resolution, *, event_id: str | None = None, **extra: Any
) -> IncidentClosed:
    incident = make_incident(incident_id, resolution=resolution, **extra)
    return IncidentClosed(
        event_id=event_id or make_event_id("closed", incident_id),
        source="scheduler",
        incident=incident,
    )


async def test_incidents_on_the_bus_become_a_guarantee_and_one_credit(
    billing: None, bus: Bus
) -> None:
    del billing
    contract = await rpc(
        bus,
        "contract_create",
        {
            "tenant": "acme",
            "term_start": Q1_START.isoformat(),
            "term_end": Q1_END.isoformat(),
            "renewal_fee_minor": 1_234_567,
            "currency": "EUR",
        },
    )
    cid = contract["contract_id"]
    assert (await rpc(bus, "contract_get", {"contract_id": cid})) == contract
    listed = await rpc(bus, "contract_list", {"tenant": "acme"})
    assert [c["contract_id"] for c in listed["items"]] == [cid]

    credits_seen: list[CreditIssued] = []
    dead_letters: list[DeadLetter] = []

    async def on_credit(msg: Msg) -> None:
        credits_seen.append(CreditIssued.model_validate_json(msg.data))

    async def on_dlq(msg: Msg) -> None:
        dead_letters.append(DeadLetter.model_validate_json(msg.data))

    await bus.subscribe_core(Subjects.CREDIT_ISSUED, on_credit)
    await bus.subscribe_core(Subjects.dlq("billing"), on_dlq)

    for i in range(10):
        res = Resolution.MIGRATED_LIVE if i < 7 else Resolution.LOST
        await bus.publish(closed_event(f"inc-{i}", res), Subjects.INCIDENT_CLOSED)
    # The same incident again under another event id (a scheduler retry that rebuilt it).
    await bus.publish(
        closed_event("inc-0", Resolution.MIGRATED_LIVE, event_id="retry-0"),
        Subjects.INCIDENT_CLOSED,
    )
    # The same incident id with other content: refused, recorded, dead-lettered.
    await bus.publish(
        closed_event("inc-1", Resolution.LOST, event_id="forged-1"), Subjects.INCIDENT_CLOSED
    )

    async def counted() -> Any:
        g = await rpc(bus, "guarantee", {"contract_id": cid})
        return g if g["eligible_failures"] == 10 else None

    g = await until(counted, "10 eligible failures in the guarantee")
    assert (g["resolved_by_migration"], g["met"], g["final"]) == (7, False, False)
    assert g["credit_minor"] == 308_642  # 0.25 x 1_234_567 = 308_641.75 -> half-up
    await until(lambda: asyncio.sleep(0, dead_letters), "the conflict's dead letter")
    assert "ledger conflict" in dead_letters[0].reason

    first = await rpc(bus, "close_term", {"contract_id": cid})
    second = await rpc(bus, "close_term", {"contract_id": cid})
    assert first["closed_now"]
    assert not second["closed_now"]
    assert first["credit"] == second["credit"]
    assert first["guarantee"]["final"]
    assert first["credit"]["amount_minor"] == 308_642

    await until(lambda: asyncio.sleep(0, credits_seen), "the CreditIssued event")
    # Exactly one CreditIssued in the stream, however often close_term was called.
    sub = await bus.js.pull_subscribe(Subjects.CREDIT_ISSUED, stream="TR_EVENTS")
    msgs = await sub.fetch(10, timeout=2)
    assert len(msgs) == 1
    assert CreditIssued.model_validate_json(msgs[0].data).credit_id == first["credit"]["credit_id"]
    await sub.unsubscribe()

    listed_credits = await rpc(bus, "credits_list", {"contract_id": cid})
    assert [c["credit_id"] for c in listed_credits["items"]] == [first["credit"]["credit_id"]]

    period = utcnow().strftime("%Y-%m")
    export = await rpc(bus, "export", {"period": period, "format": "csv"})
    rows = list(csv.DictReader(io.StringIO(export["body"])))
    assert len(rows) == 1
    assert rows[0]["BilledCost"] == "-3086.42"
    assert rows[0]["x_ContractId"] == cid
    assert rows[0]["x_LedgerChainHead"] == first["ledger_hash"]
    assert export["chain_heads"][cid]["hash"] == first["ledger_hash"]
    as_json = await rpc(bus, "export", {"period": period, "format": "json"})
    assert json.loads(as_json["body"])[0]["x_Failures"] == "10"

    assert (await rpc(bus, "ledger_verify", {}))["ok"]
    assert (await rpc(bus, "ledger_verify", {"contract_id": cid}))["checked"] == 11


async def test_invalid_requests_name_the_field(billing: None, bus: Bus) -> None:
    del billing
    base = {
        "tenant": "acme",
        "term_start": "2025-01-01T00:00:00Z",
        "term_end": "2099-01-01T00:00:00Z",
        "renewal_fee_minor": 100,
        "currency": "USD",
    }
    for change, field, code in (
        ({"currency": "ABC"}, "currency", "invalid"),
        ({"term_end": "2024-01-01T00:00:00Z"}, "term_end", "invalid"),
        ({"threshold": 0}, "threshold", "invalid"),
        ({"credit_rate": 2}, "credit_rate", "invalid"),
        ({"renewal_fee_minor": 1.5}, "renewal_fee_minor", "invalid"),
    ):
        with pytest.raises(RpcFailed) as info:
            await rpc(bus, "contract_create", {**base, **change})
        assert (info.value.error.code, info.value.error.field) == (code, field)
    contract = await rpc(bus, "contract_create", base)
    with pytest.raises(RpcFailed) as info:
        await rpc(bus, "close_term", {"contract_id": contract["contract_id"]})
    assert info.value.error.code == "conflict"
    with pytest.raises(RpcFailed) as info:
        await rpc(bus, "guarantee", {"contract_id": "nope"})
    assert info.value.error.code == "not_found"
    with pytest.raises(RpcFailed) as info:
        await rpc(bus, "export", {"period": "2026-13"})
    assert info.value.error.field == "period"
    with pytest.raises(RpcFailed) as info:
        await rpc(bus, "contract_create", {**base, "term_start": "2025-06-01T00:00:00Z"})
    assert (info.value.error.code, info.value.error.field) == ("conflict", "term_start")
    assert isinstance(datetime.fromisoformat(contract["term_start"]), datetime)


async def test_the_export_carries_the_tenants_goodput_over_each_credits_term(
    billing: None, bus: Bus
) -> None:
    del billing
    asked: list[dict[str, Any]] = []
    figures = {
        "tenant": "acme",
        "gpu_seconds_allocated": 4000.0,
        "gpu_seconds_progress": 3494.0,
        "gpu_seconds_lost": 506.0,
        "ettr": 0.8735,
        "counterfactual": {
            "gpu_seconds_lost": 1074.0,
            "gpu_hours_saved": 0.157778,
            "money_saved_minor": 39,
        },
    }

    async def scheduler(msg: Msg) -> None:  # plays the scheduler's tenant_goodput
        asked.append(json.loads(msg.data))
        await msg.respond(json.dumps({"ok": True, "result": figures}).encode())

    await bus.nc.subscribe(Subjects.rpc("scheduler", "tenant_goodput"), cb=scheduler)
    contract = await rpc(
        bus,
        "contract_create",
        {
            "tenant": "acme",
            "term_start": Q1_START.isoformat(),
            "term_end": Q1_END.isoformat(),
            "renewal_fee_minor": 1000,
            "currency": "USD",
            "price_per_gpu_hour_minor": 250,
        },
    )
    assert contract["price_per_gpu_hour_minor"] == 250
    await bus.publish(closed_event("gp-0", Resolution.LOST), Subjects.INCIDENT_CLOSED)

    async def counted() -> Any:
        g = await rpc(bus, "guarantee", {"contract_id": contract["contract_id"]})
        return g["eligible_failures"] == 1

    await until(counted, "the failure counted")
    await rpc(bus, "close_term", {"contract_id": contract["contract_id"]})
    export = await rpc(bus, "export", {"period": utcnow().strftime("%Y-%m"), "format": "json"})
    (row,) = json.loads(export["body"])
    assert (row["x_GpuSecondsAllocated"], row["x_GpuSecondsProgress"]) == ("4000.0", "3494.0")
    assert (row["x_GpuSecondsLost"], row["x_Ettr"]) == ("506.0", "0.8735")
    assert row["x_CounterfactualGpuSecondsLost"] == "1074.0"
    assert (row["x_GpuHoursSaved"], row["x_MoneySavedMinor"]) == ("0.157778", "39")
    # The term asked for is the credit's, priced at its contract's price.
    assert asked[-1]["tenant"] == "acme"
    assert datetime.fromisoformat(asked[-1]["from"].replace("Z", "+00:00")) == Q1_START
    assert datetime.fromisoformat(asked[-1]["to"].replace("Z", "+00:00")) == Q1_END
    assert (asked[-1]["price_per_gpu_hour_minor"], asked[-1]["currency"]) == (250, "USD")
