"""The guarantee gauges: each term in progress shown as the ledger evaluates it, on /metrics."""

from __future__ import annotations

import asyncio
import urllib.request
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from services.billing.gauges import GuaranteeGauges
from services.billing.ledger import Ledger
from services.billing.service import setup
from tests.helpers.inproc import InProcess, service_settings, start_in_process
from torchrelay.bus import Bus
from torchrelay.contract import IncidentClosed, Resolution, Subjects, make_event_id, utcnow

from .conftest import Q1_END, Q1_START, Q2_END, make_contract, make_incident


class Clock:
    """A clock the test moves."""

    def __init__(self, at: datetime) -> None:
        self.at = at

    def __call__(self) -> datetime:
        return self.at


def shown(registry: CollectorRegistry, name: str, contract_id: str, tenant: str) -> float | None:
    return registry.get_sample_value(name, {"contract_id": contract_id, "tenant": tenant})


async def test_terms_in_progress_are_shown_and_ended_terms_dropped(
    redis: aioredis.Redis,
) -> None:
    clock = Clock(datetime(2025, 2, 15, tzinfo=UTC))
    ledger = Ledger(redis, f"tr:billing:{uuid.uuid4().hex[:8]}", clock=clock)
    q1 = await make_contract(ledger, threshold=0.75)
    q2 = await make_contract(ledger, start=Q1_END, end=Q2_END)
    for i, resolution in enumerate([Resolution.MIGRATED_LIVE] * 2 + [Resolution.LOST]):
        await ledger.record(make_incident(f"g-{i}", resolution=resolution))
    registry = CollectorRegistry()
    gauges = GuaranteeGauges(ledger, registry)
    await gauges.load()
    await gauges.refresh()

    assert shown(registry, "torchrelay_guarantee_ratio", q1.contract_id, "acme") == 2 / 3
    assert shown(registry, "torchrelay_guarantee_threshold", q1.contract_id, "acme") == 0.75
    assert shown(registry, "torchrelay_guarantee_eligible_failures", q1.contract_id, "acme") == 3
    assert shown(registry, "torchrelay_guarantee_resolved_failures", q1.contract_id, "acme") == 2
    # The next term has not begun: nothing shown for it yet.
    assert shown(registry, "torchrelay_guarantee_ratio", q2.contract_id, "acme") is None

    clock.at = Q1_END + timedelta(days=1)
    await gauges.refresh()
    assert shown(registry, "torchrelay_guarantee_ratio", q1.contract_id, "acme") is None
    assert shown(registry, "torchrelay_guarantee_ratio", q2.contract_id, "acme") == 1.0
    assert shown(registry, "torchrelay_guarantee_eligible_failures", q2.contract_id, "acme") == 0


async def test_a_contract_created_later_is_tracked_and_an_ended_one_is_not(
    redis: aioredis.Redis,
) -> None:
    clock = Clock(Q1_START + timedelta(days=3))
    ledger = Ledger(redis, f"tr:billing:{uuid.uuid4().hex[:8]}", clock=clock)
    registry = CollectorRegistry()
    gauges = GuaranteeGauges(ledger, registry)
    await gauges.load()
    past = await make_contract(
        ledger, tenant="old", start=Q1_START - timedelta(days=90), end=Q1_START
    )
    current = await make_contract(ledger, tenant="new")
    for contract in (past, current):
        gauges.track(contract)
    await gauges.refresh()
    assert shown(registry, "torchrelay_guarantee_ratio", current.contract_id, "new") == 1.0
    assert shown(registry, "torchrelay_guarantee_ratio", past.contract_id, "old") is None


@pytest.fixture
async def billing(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus
) -> AsyncIterator[InProcess]:
    """The billing service running in this process until the test ends."""
    del redis, bus  # flushed Redis and purged streams before the service starts
    service = await start_in_process("billing", setup, service_settings(nats_url, redis_url))
    try:
        yield service
    finally:
        await service.stopped(within_s=15)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample the service's /metrics serves (read in a thread: the server is on this
    event loop)."""
    text = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_the_billing_service_shows_a_terms_ratio_on_metrics_as_incidents_close(
    billing: InProcess, bus: Bus
) -> None:
    now = utcnow()
    contract = await bus.request(
        Subjects.rpc("billing", "contract_create"),
        {
            "tenant": "acme",
            "term_start": (now - timedelta(days=1)).isoformat(),
            "term_end": (now + timedelta(days=30)).isoformat(),
            "renewal_fee_minor": 1000,
            "currency": "USD",
        },
        timeout=10,
    )
    key = (("contract_id", contract["contract_id"]), ("tenant", "acme"))
    ratio = ("torchrelay_guarantee_ratio", key)
    assert (await scrape(billing.port))[ratio] == 1.0  # no failures yet
    for i, resolution in enumerate([Resolution.MIGRATED_LIVE, Resolution.LOST]):
        incident = make_incident(f"m-{i}", resolution=resolution, detected_at=now)
        await bus.publish(
            IncidentClosed(
                event_id=make_event_id("closed", incident.incident_id),
                source="scheduler",
                incident=incident,
            ),
            Subjects.INCIDENT_CLOSED,
        )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while (await scrape(billing.port)).get(("torchrelay_guarantee_eligible_failures", key)) != 2:
        assert loop.time() < deadline, "the gauges did not show both incidents"
        await asyncio.sleep(0.05)
    assert (await scrape(billing.port))[ratio] == 0.5
