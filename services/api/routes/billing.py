"""Billing: guarantee contracts, their terms and credits, the FOCUS export and the ledger check.

Operators create contracts, close terms and export; a tenant token reads its own contracts,
guarantee and credits (and gets the same 404 for another tenant's contract as for none).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response

from services.api.deps import Gw, Operator, Who
from services.api.gateway import ApiProblem
from services.api.models import (
    PERIOD_FORMAT,
    PERIOD_PATTERN,
    TIMESTAMP_FORMAT,
    CloseTermResult,
    Contract,
    ContractRequest,
    CreditView,
    Guarantee,
    LedgerVerification,
    Page,
    Period,
    Timestamp,
)
from services.api.routes.common import Listing, Lookup, Paging
from services.api.routes.params import DEFAULT_LIMIT, Cursor, Limit, ObjectId, ObjectIdQ, TenantQ

router = APIRouter(prefix="/v1", tags=["billing"])

ContractPage = Page[Contract]
CreditViewPage = Page[CreditView]

CONTRACTS = Listing(Contract, "billing", "contract_list", Paging.SERVICE_OR_LOCAL)
CONTRACT = Lookup(Contract, "billing", "contract_get", "contract", "contract_id")
# The billing service answers every credit at once; the API pages them.
CREDITS = Listing(CreditView, "billing", "credits_list", Paging.LOCAL)


def _bad_gateway(detail: str) -> ApiProblem:
    return ApiProblem(502, "Bad Gateway", detail, kind="bad-gateway", service="billing")


@router.post(
    "/contracts",
    status_code=201,
    response_model=Contract,
    summary="create a guarantee contract",
    responses={
        422: {
            "description": f"a field is invalid; term_start and term_end must be {TIMESTAMP_FORMAT}"
        }
    },
)
async def create_contract(gw: Gw, _: Operator, body: ContractRequest) -> Contract:
    return await gw.fetch(Contract, "billing", "contract_create", body.model_dump(mode="json"))


@router.get(
    "/contracts", response_model=ContractPage, summary="contracts (a tenant token sees its own)"
)
async def list_contracts(
    gw: Gw,
    who: Who,
    tenant: TenantQ = None,
    limit: Limit = DEFAULT_LIMIT,
    cursor: Cursor = None,
) -> ContractPage:
    items, nxt = await CONTRACTS.owned_page(gw, who, tenant, limit, cursor)
    return ContractPage(items=items, next_cursor=nxt)


@router.get("/contracts/{contract_id}", response_model=Contract, summary="one contract")
async def get_contract(gw: Gw, who: Who, contract_id: ObjectId) -> Contract:
    return await CONTRACT.get(gw, contract_id, who)


@router.get(
    "/contracts/{contract_id}/guarantee",
    response_model=Guarantee,
    summary="the guarantee for the current term",
    responses={422: {"description": f"`at` is not {TIMESTAMP_FORMAT}"}},
)
async def get_guarantee(
    gw: Gw,
    who: Who,
    contract_id: ObjectId,
    at: Annotated[
        Timestamp | None,
        Query(description=f"a time inside the term (default: now): {TIMESTAMP_FORMAT}"),
    ] = None,
) -> Guarantee:
    if not who.is_operator:
        await CONTRACT.get(gw, contract_id, who)  # the same 404 for another tenant's
    return await gw.fetch(
        Guarantee,
        "billing",
        "guarantee",
        {"contract_id": contract_id, "at": at.isoformat() if at else None},
        missing=CONTRACT.missing(contract_id),
    )


@router.post(
    "/contracts/{contract_id}/close-term",
    response_model=CloseTermResult,
    summary="after term_end: final evaluation, issues the credit once (409 before)",
)
async def close_term(gw: Gw, _: Operator, contract_id: ObjectId) -> CloseTermResult:
    return await gw.fetch(
        CloseTermResult,
        "billing",
        "close_term",
        {"contract_id": contract_id},
        missing=CONTRACT.missing(contract_id),
    )


@router.get(
    "/credits",
    response_model=CreditViewPage,
    summary="credits issued (a tenant token sees its own)",
)
async def list_credits(
    gw: Gw,
    who: Who,
    contract_id: ObjectIdQ = None,
    tenant: TenantQ = None,
    limit: Limit = DEFAULT_LIMIT,
    cursor: Cursor = None,
) -> CreditViewPage:
    items, nxt = await CREDITS.owned_page(
        gw, who, tenant, limit, cursor, {"contract_id": contract_id}
    )
    return CreditViewPage(items=items, next_cursor=nxt)


@router.get(
    "/billing/export",
    summary="FOCUS 1.2 rows for a month",
    responses={
        422: {"description": f"`period` is not {PERIOD_FORMAT}"},
        200: {
            "description": "FOCUS rows",
            "content": {
                "text/csv": {"schema": {"type": "string"}},
                "application/json": {"schema": {}},
            },
        },
    },
)
async def billing_export(
    gw: Gw,
    _: Operator,
    period: Annotated[Period, Query(pattern=PERIOD_PATTERN, description=PERIOD_FORMAT)],
    format: Literal["csv", "json"] = "csv",
) -> Response:
    data = await gw.call("billing", "export", {"period": period, "format": format})
    body: Any = data.get("body") if isinstance(data, dict) else data
    filename = f"torchrelay-focus-{period}.{format}"
    disposition = {"Content-Disposition": f'attachment; filename="{filename}"'}
    if format == "csv":
        if not isinstance(body, str):
            raise _bad_gateway("billing.export answered no CSV body")
        return Response(body, media_type="text/csv; charset=utf-8", headers=disposition)
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError as exc:
            raise _bad_gateway(f"billing.export answered bad JSON: {exc}") from exc
    return JSONResponse(body, headers=disposition)


@router.get(
    "/ledger/verify",
    response_model=LedgerVerification,
    summary="recompute the ledger's hash chain; first_bad names the first bad entry",
)
async def ledger_verify(gw: Gw, _: Operator, contract_id: ObjectIdQ = None) -> LedgerVerification:
    return await gw.fetch(
        LedgerVerification, "billing", "ledger_verify", {"contract_id": contract_id}
    )
