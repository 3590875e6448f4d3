"""The FastAPI dependencies every route is built of: who is calling, and what to ask.

A route names what it needs in its signature (``who: Who``, ``_: Operator``, ``gw: Gw``,
``lists: Lists``); the auth check (401 without a known bearer token, 403 for a tenant token on
an operator route) and the 503 of an API still starting happen here, once for all routes.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.api.auth import Principal, TokenStoreUnavailable
from services.api.cache import ResponseCache
from services.api.gateway import ApiProblem, Gateway, forbidden, unauthorized
from services.api.state import state_of

_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="a token from POST /v1/tokens, or the operator token",
)


async def gateway(request: Request) -> Gateway:
    return state_of(request).require()[0]


async def list_cache(request: Request) -> ResponseCache[bytes]:
    return state_of(request).lists


async def principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller, from ``Authorization: Bearer``; 401 when absent or unknown."""
    if credentials is None:
        raise unauthorized(
            "this route needs Authorization: Bearer <token>; use the "
            "operator_token of stack.json, or a token from POST /v1/tokens"
        )
    _, tokens = state_of(request).require()
    try:
        who = await tokens.authenticate(credentials.credentials)
    except TokenStoreUnavailable as exc:
        raise ApiProblem(
            503,
            "Service Unavailable",
            f"{exc}; check REDIS_URL",
            kind="service-unavailable",
            service="redis",
            headers={"Retry-After": "5"},
        ) from exc
    if who is None:
        raise unauthorized(
            "the bearer token is not known to this API; ask an operator for "
            "a token (POST /v1/tokens)"
        )
    return who


async def operator(who: Annotated[Principal, Depends(principal)]) -> Principal:
    """The caller, who must hold an operator token; 403 for a tenant token."""
    if not who.is_operator:
        raise forbidden(
            "this route is for operators; a tenant token reads only its own "
            "jobs, incidents, contracts, guarantee and credits"
        )
    return who


Who = Annotated[Principal, Depends(principal)]
Operator = Annotated[Principal, Depends(operator)]
Gw = Annotated[Gateway, Depends(gateway)]
Lists = Annotated[ResponseCache[bytes], Depends(list_cache)]
