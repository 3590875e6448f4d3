"""Goodput: a job's, and a tenant's per window and per contract term (docs/design.md §14).

The scheduler computes the figures (``torchrelay.goodput``) from its registry, its
incidents and the agents' step times; the API adds who may see them and the
counterfactual's settings: the query's, else the job's checkpoint interval and the
operator's defaults (``TORCHRELAY_GOODPUT_*``), and a contract's price per GPU-hour for its
term.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request

from services.api.deps import Gw, Who
from services.api.gateway import not_found, parse
from services.api.models import (
    MAX_MINOR,
    TIMESTAMP_FORMAT,
    Contract,
    Currency,
    JobGoodput,
    TenantGoodput,
    Timestamp,
)
from services.api.routes.common import Listing, Paging
from services.api.routes.jobs import JOB
from services.api.routes.params import TOKEN_PATTERN, JobId
from services.api.settings import ApiSettings
from services.api.state import state_of
from torchrelay.goodput import price_for, term_window

router = APIRouter(prefix="/v1", tags=["jobs"])

TENANT_CONTRACTS = Listing(Contract, "billing", "contract_list", Paging.SERVICE_OR_LOCAL)

CheckpointEvery = Annotated[
    int | None,
    Query(
        ge=1,
        le=10**9,
        description="steps between checkpoints for the counterfactual (default: the job's "
        "--checkpoint-every, else TORCHRELAY_GOODPUT_CHECKPOINT_EVERY)",
    ),
]
RestartS = Annotated[
    float | None,
    Query(
        ge=0,
        le=10**7,
        description="seconds one checkpoint restart takes (default TORCHRELAY_GOODPUT_RESTART_S)",
    ),
]
Price = Annotated[
    int | None,
    Query(
        ge=0,
        le=MAX_MINOR,
        description="price of a GPU-hour in minor units (default: the contract's, else "
        "TORCHRELAY_GOODPUT_PRICE_PER_GPU_HOUR_MINOR)",
    ),
]
CurrencyQ = Annotated[Currency | None, Query(description="ISO 4217 code of the price")]
TenantName = Annotated[str, Path(pattern=TOKEN_PATTERN, max_length=128)]


def _defaults(request: Request) -> ApiSettings:
    settings = state_of(request).settings
    return settings if settings is not None else ApiSettings()


def _assumptions(
    settings: ApiSettings,
    checkpoint_every: int | None,
    restart_s: float | None,
    price: int | None,
    currency: str | None,
) -> dict[str, Any]:
    return {
        "checkpoint_every": checkpoint_every,
        "default_checkpoint_every": settings.goodput_checkpoint_every,
        "restart_s": settings.goodput_restart_s if restart_s is None else restart_s,
        "price_per_gpu_hour_minor": (
            settings.goodput_price_per_gpu_hour_minor if price is None else price
        ),
        "currency": currency or settings.goodput_currency,
    }


@router.get(
    "/jobs/{job_id}/goodput",
    response_model=JobGoodput,
    summary="a job's goodput: allocated, progress, each incident's lost GPU time, ETTR and "
    "what checkpoint restart would have cost",
)
async def job_goodput(
    request: Request,
    gw: Gw,
    who: Who,
    job_id: JobId,
    checkpoint_every: CheckpointEvery = None,
    restart_s: RestartS = None,
    price_per_gpu_hour_minor: Price = None,
    currency: CurrencyQ = None,
) -> JobGoodput:
    job = await JOB.get(gw, job_id, who)  # the same 404 for another tenant's job
    settings = _defaults(request)
    if price_per_gpu_hour_minor is None:
        contract = await _contract_now(gw, job.tenant)
        if contract is not None:
            price_per_gpu_hour_minor, currency = price_for(
                None, currency, contract.price_per_gpu_hour_minor, contract.currency
            )
    body = {
        "job_id": job_id,
        **_assumptions(settings, checkpoint_every, restart_s, price_per_gpu_hour_minor, currency),
    }
    data = await gw.call("scheduler", "job_goodput", body, missing=JOB.missing(job_id))
    figures = parse(JobGoodput, data, "scheduler", "job_goodput")
    if not who.sees(figures.tenant):
        raise JOB.missing(job_id)
    return figures


@router.get(
    "/tenants/{tenant}/goodput",
    response_model=TenantGoodput,
    summary="a tenant's goodput in [from, to): summed over its jobs, and per contract term",
    responses={422: {"description": f"`from` or `to` is not {TIMESTAMP_FORMAT}"}},
)
async def tenant_goodput(
    request: Request,
    gw: Gw,
    who: Who,
    tenant: TenantName,
    since: Annotated[Timestamp | None, Query(alias="from")] = None,
    until: Annotated[Timestamp | None, Query(alias="to")] = None,
    checkpoint_every: CheckpointEvery = None,
    restart_s: RestartS = None,
    price_per_gpu_hour_minor: Price = None,
    currency: CurrencyQ = None,
) -> TenantGoodput:
    if not who.sees(tenant):
        # A tenant token asking for another tenant learns nothing: the same answer as for a
        # tenant with no jobs would confirm it exists, so it is a 404 like another's job.
        raise not_found("tenant", tenant, "tenant")
    settings = _defaults(request)
    base = _assumptions(settings, checkpoint_every, restart_s, price_per_gpu_hour_minor, currency)
    span = {"from": _iso(since), "to": _iso(until)}
    data = await gw.call("scheduler", "tenant_goodput", {"tenant": tenant, **span, **base})
    figures = parse(TenantGoodput, data, "scheduler", "tenant_goodput")
    terms = []
    contracts, _ = await TENANT_CONTRACTS.page(gw, 1000, None, {"tenant": tenant}, who=who)
    for contract in contracts:
        window = term_window(contract.term_start, contract.term_end, since, until)
        if window is None:
            continue
        lo, hi = window
        price, in_currency = price_for(
            price_per_gpu_hour_minor,
            currency,
            contract.price_per_gpu_hour_minor,
            contract.currency,
        )
        priced = _assumptions(settings, checkpoint_every, restart_s, price, in_currency)
        term = await gw.call(
            "scheduler",
            "tenant_goodput",
            {"tenant": tenant, "from": _iso(lo), "to": _iso(hi), **priced},
        )
        if isinstance(term, dict):
            term.pop("jobs", None)
            terms.append(
                {
                    **term,
                    "contract_id": contract.contract_id,
                    "term_start": _iso(contract.term_start),
                    "term_end": _iso(contract.term_end),
                }
            )
    return figures.model_copy(update={"terms": terms})


async def _contract_now(gw: Any, tenant: str) -> Contract | None:
    contracts, _ = await TENANT_CONTRACTS.page(gw, 1000, None, {"tenant": tenant})
    now = datetime.now().astimezone()
    for contract in contracts:
        if contract.term_start <= now < contract.term_end:
            return contract
    return None


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat()
