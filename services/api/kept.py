"""Kept answers served in front of FastAPI: the hot path of ``GET /v1/incidents``.

Two hundred dashboards polling one list ask the same question thousands of times a second.
The route keeps each answer it made for ``TORCHRELAY_LIST_CACHE_S`` (the list cache) under
:func:`incidents_key`, and the token store remembers each token it authenticated for
``TORCHRELAY_TOKEN_CACHE_S`` (the token cache). When both hold for a request, it is answered
here with the route's stored bytes and the route's status and headers, before routing,
dependency resolution, parameter validation and FastAPI's per-request telemetry span (a kept
answer asks no service, so there is no trace to continue). Everything else — no token, a
token not remembered, another route or method, a query not answered lately — goes to
FastAPI, which checks the token (401/403), validates the query and fills both caches.

What the route decides stays decided the same way here: the key holds the token's scope and
tenant (a tenant never gets an answer made for another) and the raw query string (a query
string that validated once validates the same way again); a revoked token is no longer
remembered once its token-cache entry expires, and is then refused by the route.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.api.auth import Principal
    from services.api.cache import ResponseCache
    from services.api.state import ApiState

INCIDENTS_PATH = "/v1/incidents"
_JSON = b"application/json"


def incidents_key(who: Principal, query_string: bytes) -> tuple[Any, ...]:
    """The cache key of a ``GET /v1/incidents`` answer: the token's scope and tenant (a tenant
    never gets an answer made for another) and the query exactly as sent (a query string
    that validated once validates the same way again)."""
    return ("GET /v1/incidents", who.scope, who.tenant, query_string)


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The bearer token of ``Authorization`` as FastAPI's ``HTTPBearer`` reads it: the first
    such header, scheme ``bearer`` in any case, the rest stripped; None when there is none."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            token = token.strip()
            return token if scheme.lower() == "bearer" and token else None
    return None


class KeptAnswers:
    """Answers a request from the list cache when its token is remembered (see the module)."""

    def __init__(self, state: ApiState) -> None:
        self.state = state
        # Kept answers are counted in the route's request histogram, as the route would be.
        self._observe = state.http_seconds.labels("GET", INCIDENTS_PATH, "200").observe
        self._last_body = b""
        self._last_start: dict[str, Any] = {}

    def key(self, scope: MutableMapping[str, Any]) -> tuple[Any, ...] | None:
        """The list-cache key of this request if it may be answered here, else None."""
        if scope["method"] != "GET" or scope["path"] != INCIDENTS_PATH:
            return None
        tokens = self.state.tokens
        if tokens is None:
            return None
        token = bearer_token(scope["headers"])
        if token is None:
            return None
        who = tokens.remembered(token)
        if who is None:
            return None
        return incidents_key(who, scope.get("query_string", b""))

    async def answer(self, scope: MutableMapping[str, Any], send: Any) -> bool:
        """Send the kept answer of this HTTP request and return True, or return False (the
        request is FastAPI's)."""
        started = time.perf_counter()
        key = self.key(scope)
        if key is None:
            return False
        lists: ResponseCache[bytes] = self.state.lists
        body = lists.kept(key)
        if body is None:
            # The answer is being made for another request: wait for it rather than go
            # through the app only to join the same computation there.
            pending = lists.pending(key)
            if pending is None:
                return False
            try:
                body = await asyncio.shield(pending)
            except Exception:  # its error is the route's to answer, with its problem document
                return False
        if body is not self._last_body:
            self._last_body = body
            self._last_start = {
                "type": "http.response.start",
                "status": 200,
                # What the route's Response(body, media_type="application/json") sends.
                "headers": [(b"content-length", str(len(body)).encode()), (b"content-type", _JSON)],
            }
        await send(self._last_start)
        await send({"type": "http.response.body", "body": body})
        with contextlib.suppress(Exception):  # a metric must never fail an answer sent
            self._observe(time.perf_counter() - started)
        return True
