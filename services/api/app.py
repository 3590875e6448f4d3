"""The portal API: one authenticated HTTP surface over every service (docs/design.md §9).

Every ``/v1`` route checks the bearer token, validates its input with pydantic, asks the
owning service over NATS request/reply and answers JSON; errors are RFC 9457 problem
documents naming the offending field. A tenant token sees only its own jobs, incidents,
contracts, guarantee and credits, and gets the same 404 for another tenant's object as for
one that does not exist.

This module puts the app together: the routes of :mod:`services.api.routes` (one module per
resource), the error handlers (:mod:`services.api.errors`), the OpenAPI document
(:mod:`services.api.openapi`), the shared state and lifespan (:mod:`services.api.state`), the
dashboard (:mod:`services.api.ui`), and in front of FastAPI the body limit and the kept
answers.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI

from services.api.errors import add_error_handlers
from services.api.kept import INCIDENTS_PATH, KeptAnswers
from services.api.limits import BodyLimit
from services.api.openapi import build_openapi
from services.api.routes import (
    billing,
    fleet,
    goodput,
    health,
    incidents,
    jobs,
    spares,
    tokens,
)
from services.api.settings import DEFAULT_MAX_BODY_BYTES, ApiSettings
from services.api.state import ApiState, bootstrap_operator_token, lifespan
from services.api.ui import add_ui
from torchrelay import __version__
from torchrelay.bus import Bus

# In the order of the OpenAPI document's tags.
ROUTERS = (health, tokens, fleet, spares, jobs, goodput, incidents, billing)


class _HttpMetrics:
    """Pure ASGI middleware timing each request by its route template (cheap, no buffering)."""

    def __init__(self, app: Callable[..., Awaitable[None]], state: ApiState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]

        async def _send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            self.state.http_seconds.labels(scope.get("method", "?"), path, str(status[0])).observe(
                time.perf_counter() - started
            )


class _PortalApp(FastAPI):
    """FastAPI with the kept answers (:mod:`services.api.kept`) in front of it: a repeated
    ``GET /v1/incidents`` of a remembered token is answered before routing and before
    FastAPI's per-request telemetry; every other request is FastAPI's. In front of both, the
    body limit (:mod:`services.api.limits`) refuses an oversized body with 413 unread."""

    kept: KeptAnswers | None = None
    # The body limit, outermost: set by create_app (services.api.limits).
    body_limit: BodyLimit | None = None

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if self.body_limit is not None and scope["type"] == "http":
            await self.body_limit(scope, receive, send)
            return
        await self._serve(scope, receive, send)

    async def _serve(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        kept = self.kept
        if (
            kept is not None
            and scope["type"] == "http"
            and scope["path"] == INCIDENTS_PATH
            and await kept.answer(scope, send)
        ):
            return
        await super().__call__(scope, receive, send)


def create_app(
    settings: ApiSettings | None = None, *, bus: Bus | None = None, redis: Any = None
) -> FastAPI:
    """The FastAPI app; connections not given are opened (and closed) by its lifespan.

    Args:
        settings: the API's settings; read from the environment at start when None.
        bus: a connected bus to use instead of connecting to ``NATS_URL``.
        redis: a redis.asyncio client to use instead of connecting to ``REDIS_URL``.
    """
    st = ApiState()
    st.bus, st.redis, st.settings = bus, redis, settings

    app = _PortalApp(
        title="torchrelay portal API",
        version=__version__,
        lifespan=lifespan(st),
        # One span per HTTP request (its trace goes on over NATS to the service); FastAPI's
        # extra spans for dependency resolution, the endpoint and serialization cost about
        # as much CPU again as a cached answer and are left out.
        telemetry={"operation_spans": False},
        description=(
            "One authenticated surface over every torchrelay service. Send "
            "`Authorization: Bearer <token>`; errors are RFC 9457 problem documents "
            "naming the offending `field`. Lists take `limit` and `cursor` (the "
            "`next_cursor` of the previous page) and return `{items, next_cursor}`. "
            "Date-times are RFC 3339 text with a UTC offset (numbers are refused). A request "
            "body over TORCHRELAY_API_MAX_BODY_BYTES (default 1 MiB) is refused with 413 "
            "before it is read."
        ),
        openapi_tags=[
            {"name": n}
            for n in ("health", "tokens", "fleet", "spares", "jobs", "incidents", "billing")
        ],
    )
    app.state.api = st
    for module in ROUTERS:
        app.include_router(module.router)
    add_error_handlers(app)
    add_ui(app)
    app.openapi = lambda: build_openapi(app)  # type: ignore[method-assign]
    app.add_middleware(_HttpMetrics, state=st)
    app.kept = KeptAnswers(st)

    def max_body_bytes() -> int:
        return st.settings.max_body_bytes if st.settings is not None else DEFAULT_MAX_BODY_BYTES

    app.body_limit = BodyLimit(app._serve, max_body_bytes)
    return app


def openapi_document() -> dict[str, Any]:
    """The portal API's OpenAPI document (deterministic; ``make proto`` writes it)."""
    return create_app().openapi()


__all__ = ["ApiState", "bootstrap_operator_token", "create_app", "openapi_document"]
