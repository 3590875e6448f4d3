"""Health and metrics: ``/healthz``, ``/readyz`` and ``/metrics`` (no token needed)."""

from __future__ import annotations

import asyncio
import contextlib
import os

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.api.state import state_of

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="liveness")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="ready when NATS is connected and Redis answers",
    responses={503: {"description": "not ready"}},
)
async def readyz(request: Request) -> JSONResponse:
    st = state_of(request)
    nats_ok = st.bus is not None and st.bus.nc.is_connected
    redis_ok = False
    if st.redis is not None:
        with contextlib.suppress(Exception):
            redis_ok = bool(await asyncio.wait_for(st.redis.ping(), 1.0))
    ready = nats_ok and redis_ok and st.tokens is not None
    body = {
        "ready": ready,
        "service": "api",
        "pid": os.getpid(),  # the supervisor tells its own process from another on the port
        "nats": "connected" if nats_ok else "down",
        "redis": "ok" if redis_ok else "down",
    }
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    return Response(
        generate_latest(state_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST
    )
