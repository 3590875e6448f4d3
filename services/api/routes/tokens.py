"""Tokens: issue, list and revoke API tokens (operators only; only hashes are kept)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.api.deps import Operator
from services.api.gateway import ApiProblem
from services.api.models import Page, TokenInfo, TokenIssued, TokenRequest
from services.api.routes.common import page_locally
from services.api.routes.params import DEFAULT_LIMIT, Cursor, Limit, TokenId
from services.api.state import state_of

log = logging.getLogger("torchrelay.api")

router = APIRouter(prefix="/v1", tags=["tokens"])

TokenInfoPage = Page[TokenInfo]


@router.post(
    "/tokens",
    status_code=201,
    response_model=TokenIssued,
    summary="create a token (shown once; only its hash is kept)",
)
async def create_token(request: Request, body: TokenRequest, who: Operator) -> JSONResponse:
    st = state_of(request)
    _, tokens = st.require()
    token, issued = await tokens.issue(body.scope, body.tenant)
    st.tokens_issued.labels(body.scope).inc()
    log.info(
        "token issued",
        extra={
            "token_id": issued.token_id,
            "scope": body.scope,
            "tenant": body.tenant,
            "by": who.token_id,
        },
    )
    out = TokenIssued(token=token, token_id=issued.token_id, scope=body.scope, tenant=body.tenant)
    return JSONResponse(
        out.model_dump(mode="json"), status_code=201, headers={"Cache-Control": "no-store"}
    )


@router.get(
    "/tokens",
    response_model=TokenInfoPage,
    summary="the stored tokens (ids, scopes, tenants; never the secrets)",
)
async def list_tokens(
    request: Request, _: Operator, limit: Limit = DEFAULT_LIMIT, cursor: Cursor = None
) -> TokenInfoPage:
    st = state_of(request)
    tokens = st.require()[1]
    rows = [
        TokenInfo.model_validate({**row, "configured": row["token_id"] == st.configured_id})
        for row in await tokens.listed()
    ]
    items, next_cursor = page_locally(rows, limit, cursor)
    return TokenInfoPage(items=items, next_cursor=next_cursor)


@router.delete(
    "/tokens/{token_id}",
    status_code=204,
    summary="revoke a token (refused here at once, by other API replicas within "
    "TORCHRELAY_TOKEN_CACHE_S)",
)
async def revoke_token(request: Request, token_id: TokenId, who: Operator) -> Response:
    st = state_of(request)
    tokens = st.require()[1]
    if token_id == st.configured_id:
        raise ApiProblem(
            409,
            "Conflict",
            f"token {token_id} is the operator token of the API's settings "
            "(TORCHRELAY_OPERATOR_TOKEN): it is stored again at every start; change the "
            "setting to replace it",
            kind="conflict",
            field="token_id",
        )
    if not await tokens.revoke(token_id):
        raise ApiProblem(
            404,
            "Not Found",
            f"no token has id {token_id}",
            kind="not-found",
            field="token_id",
        )
    log.info("token revoked", extra={"token_id": token_id, "by": who.token_id})
    return Response(status_code=204)
