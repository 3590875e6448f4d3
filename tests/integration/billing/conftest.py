"""Helpers of the billing integration tests: a ledger on the real Redis, incident builders."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
import redis.asyncio as aioredis

from services.billing.ledger import Ledger
from services.billing.rules import ContractRequest
from torchrelay.contract import Contract, FaultKind, Incident, Resolution, Severity

Q1_START = datetime(2025, 1, 1, tzinfo=UTC)
Q1_END = datetime(2025, 4, 1, tzinfo=UTC)
Q2_END = datetime(2025, 7, 1, tzinfo=UTC)


def make_incident(
    incident_id: str,
    *,
    tenant: str = "acme",
    detected_at: datetime = datetime(2025, 2, 1, tzinfo=UTC),
    resolution: Resolution = Resolution.MIGRATED_LIVE,
    kind: FaultKind = FaultKind.GPU_LOST,
    **extra: Any,
) -> Incident:
    return Incident(
        incident_id=incident_id,
        tenant=tenant,
        job_id="job-1",
        rank=0,
        node="node-1",
        gpu=0,
        fault_kind=kind,
        severity=Severity.FATAL,
        detected_at=detected_at,
        resolved_at=detected_at,
        resolution=resolution,
        **extra,
    )


async def make_contract(
    ledger: Ledger,
    *,
    tenant: str = "acme",
    start: datetime = Q1_START,
    end: datetime = Q1_END,
    fee: int = 1_000_000,
    **extra: Any,
) -> Contract:
    body: dict[str, Any] = {
        "tenant": tenant,
        "term_start": start,
        "term_end": end,
        "renewal_fee_minor": fee,
        "currency": "USD",
    }
    body.update(extra)
    contract, _ = await ledger.create_contract(ContractRequest.model_validate(body))
    return contract


@pytest.fixture
async def ledger(redis: aioredis.Redis) -> Ledger:
    """A ledger on the session's Redis under a prefix of its own."""
    return Ledger(redis, f"tr:billing:{uuid.uuid4().hex[:8]}")
