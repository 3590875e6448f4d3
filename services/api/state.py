"""What the API's routes share, and its lifespan: opening and closing it.

One :class:`ApiState` per app, on ``app.state.api``: the settings, the connections (NATS bus,
Redis), the gateway to the services, the token store, the list cache and the metrics. Routes
reach it through :func:`state_of` (or the dependencies of :mod:`services.api.deps`); the
app's lifespan (:func:`lifespan`) fills it at start and empties it at stop.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import Counter, Histogram

from services.api.auth import TokenStore, connect_token_redis, new_token
from services.api.cache import ResponseCache
from services.api.gateway import ApiProblem, Gateway
from services.api.settings import ApiSettings
from torchrelay.bus import Bus
from torchrelay.observability import ServiceMetrics

log = logging.getLogger("torchrelay.api")


class ApiState:
    """What the routes share: the gateway to the services and the token store."""

    def __init__(self) -> None:
        self.settings: ApiSettings | None = None
        self.gateway: Gateway | None = None
        self.tokens: TokenStore | None = None
        self.configured_id: str | None = None  # token_id of the settings' operator token
        self.lists: ResponseCache[bytes] = ResponseCache(0.0)
        self.bus: Bus | None = None
        self.redis: Any = None
        self.metrics = ServiceMetrics("api")
        self.http_seconds = Histogram(
            "torchrelay_http_request_seconds",
            "HTTP request latency by route",
            ["method", "route", "status"],
            registry=self.metrics.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.tokens_issued = Counter(
            "torchrelay_api_tokens_issued_total",
            "Tokens issued, by scope",
            ["scope"],
            registry=self.metrics.registry,
        )

    def require(self) -> tuple[Gateway, TokenStore]:
        if self.gateway is None or self.tokens is None:
            raise ApiProblem(
                503, "Service Unavailable", "the API is still starting", kind="starting"
            )
        return self.gateway, self.tokens


def state_of(request: Request) -> ApiState:
    st: ApiState = request.app.state.api
    return st


# --------------------------------------------------------------------------- lifespan


async def _connect(st: ApiState, settings: ApiSettings) -> list[Callable[[], Awaitable[Any]]]:
    """Open what the app was not given; return the closers of what it opened."""
    closers: list[Callable[[], Awaitable[Any]]] = []
    if st.redis is None:
        st.redis = await connect_token_redis(settings.redis_url, settings.connect_timeout_s)
        closers.append(st.redis.aclose)
    if st.bus is None:
        creds = str(settings.nats_credentials) if settings.nats_credentials else None
        st.bus = await Bus.connect(
            settings.nats_url,
            "api",
            credentials=creds,
            timeout=settings.connect_timeout_s,
            metrics=st.metrics,
        )
        closers.append(st.bus.close)
    return closers


async def bootstrap_operator_token(tokens: TokenStore, settings: ApiSettings) -> str | None:
    """Store the configured operator token's hash; in development, make one if none is set.

    Returns the token generated for development (to print), or None.
    """
    if settings.operator_token is not None:
        await tokens.store(settings.operator_token.get_secret_value(), "operator")
        return None
    if settings.environment == "production":  # refused by the settings already
        raise RuntimeError("TORCHRELAY_OPERATOR_TOKEN is required in production")
    token = new_token(development=True)
    await tokens.store(token, "operator")
    return token


def lifespan(st: ApiState) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan over ``st``: settings read if not given, connections not given
    opened (and closed at stop), the token store opened and the operator token stored."""

    @asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        from torchrelay.settings import load_settings

        cfg = st.settings or load_settings(ApiSettings)
        st.settings = cfg
        closers = await _connect(st, cfg)
        try:
            pepper = cfg.token_pepper.get_secret_value() if cfg.token_pepper else None
            if pepper is None and cfg.environment == "production":
                log.warning(
                    "TORCHRELAY_TOKEN_PEPPER is not set: the token-hash key is kept "
                    "in Redis next to the hashes; set it to keep them apart"
                )
            st.tokens = await TokenStore.open(st.redis, pepper, cache_s=cfg.token_cache_s)
            generated = await bootstrap_operator_token(st.tokens, cfg)
            if cfg.operator_token is not None:
                st.configured_id = st.tokens.token_id(cfg.operator_token.get_secret_value())
            if generated is not None:
                log.warning(
                    "TORCHRELAY_OPERATOR_TOKEN is not set; development operator "
                    "token for this API: %s",
                    generated,
                )
            assert st.bus is not None
            st.gateway = Gateway(st.bus, cfg.rpc_timeout_s)
            # Refreshed ahead in the last quarter of their time: a busy query's answer is
            # replaced before it expires instead of every client waiting for it each second.
            st.lists = ResponseCache[bytes](cfg.list_cache_s, refresh_s=cfg.list_cache_s / 4)
            yield
        finally:
            st.gateway = None
            st.tokens = None
            for close in reversed(closers):
                with contextlib.suppress(Exception):
                    await close()

    return run
