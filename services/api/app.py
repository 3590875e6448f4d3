"""The portal API: one authenticated HTTP surface over every service (docs/design.md §9).

Every ``/v1`` route checks the bearer token, validates its input with pydantic, asks the
owning service over NATS request/reply and answers JSON; errors are RFC 9457 problem
documents naming the offending field. A tenant token sees only its own jobs, incidents,
contracts, guarantee and credits, and gets the same 404 for another tenant's object as for
one that does not exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from fastapi import Body, Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.api.auth import (
    Principal,
    TokenStore,
    TokenStoreUnavailable,
    connect_token_redis,
    new_token,
)
from services.api.cache import ResponseCache
from services.api.gateway import (
    ApiProblem,
    Gateway,
    forbidden,
    invalid,
    items_of,
    not_found,
    parse,
    parse_list,
    unauthorized,
)
from services.api.kept import INCIDENTS_PATH, KeptAnswers, incidents_key
from services.api.limits import BodyLimit
from services.api.models import (
    CURSOR_PATTERN,
    PERIOD_FORMAT,
    PERIOD_PATTERN,
    SPARE_CURSOR_PATTERN,
    TIMESTAMP_FORMAT,
    CloseTermResult,
    ClusterView,
    Contract,
    ContractRequest,
    CreditView,
    DrainAccepted,
    DrainRequest,
    Guarantee,
    Incident,
    JobView,
    LedgerVerification,
    NodeReturned,
    NodeView,
    Page,
    Period,
    Problem,
    SpareDepth,
    SpareRegistration,
    SpareSlot,
    Timeline,
    Timestamp,
    TokenInfo,
    TokenIssued,
    TokenRequest,
)
from services.api.settings import DEFAULT_MAX_BODY_BYTES, ApiSettings
from torchrelay import __version__
from torchrelay.bus import Bus
from torchrelay.contract import Resolution, SpareState
from torchrelay.observability import ServiceMetrics

log = logging.getLogger("torchrelay.api")

NAME_PATTERN = r"^[A-Za-z0-9_\-.:]{1,128}$"
TOKEN_PATTERN = r"^[A-Za-z0-9_\-]{1,128}$"  # noqa: S105 - a regex
ID_PATTERN = r"^[A-Za-z0-9_\-.:]{1,128}$"
PROBLEM_JSON = "application/problem+json"
DEFAULT_LIMIT = 50
MAX_LIMIT = 500

# --------------------------------------------------------------------------- parameters

Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description="page size")]
Cursor = Annotated[
    str | None,
    Query(
        pattern=CURSOR_PATTERN,
        max_length=9,
        description="next_cursor of the previous page: an offset, 1-9 digits",
    ),
]
SpareCursor = Annotated[
    str | None,
    Query(
        pattern=SPARE_CURSOR_PATTERN,
        max_length=256,
        description="next_cursor of the previous page: the last slot_id it listed",
    ),
]
NodeName = Annotated[str, Path(pattern=NAME_PATTERN, max_length=128)]
JobId = Annotated[str, Path(pattern=TOKEN_PATTERN, max_length=128)]
ObjectId = Annotated[str, Path(pattern=ID_PATTERN, max_length=128)]
TokenId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$", description="token_id of the token")]
ClusterQ = Annotated[str | None, Query(pattern=NAME_PATTERN, max_length=128)]
TenantQ = Annotated[str | None, Query(pattern=TOKEN_PATTERN, max_length=128)]

# Parametrized once: building Page[X] per request costs a class lookup every time.
ClusterViewPage = Page[ClusterView]
NodeViewPage = Page[NodeView]
SpareSlotPage = Page[SpareSlot]
SpareDepthPage = Page[SpareDepth]
JobViewPage = Page[JobView]
IncidentPage = Page[Incident]
ContractPage = Page[Contract]
CreditViewPage = Page[CreditView]
TokenInfoPage = Page[TokenInfo]

_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="a token from POST /v1/tokens, or the operator token",
)


# --------------------------------------------------------------------------- pure helpers


def page_locally(items: list[Any], limit: int, cursor: str | None) -> tuple[list[Any], str | None]:
    """Paginate a list a service returns whole: the cursor is the offset of the next item."""
    offset = 0
    if cursor is not None:
        if not cursor.isdigit() or len(cursor) > 9:
            raise invalid("cursor", "not a cursor this list returned")
        offset = int(cursor)
    page = items[offset : offset + limit]
    more = offset + limit < len(items)
    return page, (str(offset + limit) if more else None)


def merge_clusters(clusters: list[dict[str, Any]], depth: list[SpareDepth]) -> list[ClusterView]:
    """The detector's clusters with the spare pool's counts added (spare-only clusters too)."""
    spares: dict[str, tuple[int, int]] = {}
    for d in depth:
        available, domains = spares.get(d.cluster, (0, 0))
        spares[d.cluster] = (available + d.available, domains + 1)
    out: dict[str, ClusterView] = {}
    for c in clusters:
        view = ClusterView.model_validate(c)
        available, domains = spares.get(view.cluster, (0, 0))
        out[view.cluster] = view.model_copy(
            update={"spares_available": available, "spare_domains": domains}
        )
    for name, (available, domains) in spares.items():
        if name not in out:
            out[name] = ClusterView(cluster=name, spares_available=available, spare_domains=domains)
    return [out[k] for k in sorted(out)]


def owned(items: list[Any], principal: Principal) -> list[Any]:
    """Drop what the principal may not see (a second check after the service's filter)."""
    if principal.is_operator:
        return items
    return [i for i in items if principal.sees(getattr(i, "tenant", None))]


def tenant_filter(principal: Principal, requested: str | None) -> tuple[str | None, bool]:
    """The tenant to ask the service for, and False when the answer must be empty.

    An operator filters freely; a tenant token is pinned to its tenant, and asking for
    another tenant yields nothing rather than an error that would confirm it exists.
    """
    if principal.is_operator:
        return requested, True
    if requested is not None and requested != principal.tenant:
        return principal.tenant, False
    return principal.tenant, True


def _json(model: BaseModel) -> Response:
    """A model as a JSON response, serialised once (the hot list routes skip FastAPI's
    re-validation of an already validated model)."""
    return Response(model.model_dump_json(), media_type="application/json")


# --------------------------------------------------------------------------- app state


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


# --------------------------------------------------------------------------- routes


def _add_routes(app: FastAPI) -> None:
    v1 = "/v1"

    @app.get("/healthz", tags=["health"], summary="liveness")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        tags=["health"],
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

    @app.get(
        "/metrics", tags=["health"], summary="Prometheus metrics", response_class=PlainTextResponse
    )
    async def metrics(request: Request) -> Response:
        return Response(
            generate_latest(state_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    # ----------------------------------------------------------------- tokens

    @app.post(
        f"{v1}/tokens",
        tags=["tokens"],
        status_code=201,
        response_model=TokenIssued,
        summary="create a token (shown once; only its hash is kept)",
    )
    async def create_token(request: Request, body: TokenRequest, who: Operator) -> JSONResponse:
        _, tokens = state_of(request).require()
        token, issued = await tokens.issue(body.scope, body.tenant)
        state_of(request).tokens_issued.labels(body.scope).inc()
        log.info(
            "token issued",
            extra={
                "token_id": issued.token_id,
                "scope": body.scope,
                "tenant": body.tenant,
                "by": who.token_id,
            },
        )
        out = TokenIssued(
            token=token, token_id=issued.token_id, scope=body.scope, tenant=body.tenant
        )
        return JSONResponse(
            out.model_dump(mode="json"), status_code=201, headers={"Cache-Control": "no-store"}
        )

    @app.get(
        f"{v1}/tokens",
        tags=["tokens"],
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

    @app.delete(
        f"{v1}/tokens/{{token_id}}",
        tags=["tokens"],
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

    # ----------------------------------------------------------------- fleet

    @app.get(
        f"{v1}/clusters",
        tags=["fleet"],
        response_model=ClusterViewPage,
        summary="clusters with node and spare counts",
    )
    async def list_clusters(
        gw: Gw, _: Operator, limit: Limit = DEFAULT_LIMIT, cursor: Cursor = None
    ) -> ClusterViewPage:
        clusters_raw, depth_raw = await asyncio.gather(
            gw.call("detector", "cluster_list", {}), gw.call("spare_pool", "depth", {})
        )
        clusters, _c = items_of(clusters_raw, "detector", "cluster_list")
        depth_items, _d = items_of(depth_raw, "spare_pool", "depth")
        depth = parse_list(SpareDepth, depth_items, "spare_pool", "depth")
        parse_list(ClusterView, clusters, "detector", "cluster_list")
        merged = merge_clusters(clusters, depth)
        items, nxt = page_locally(merged, limit, cursor)
        return ClusterViewPage(items=items, next_cursor=nxt)

    @app.get(
        f"{v1}/nodes",
        tags=["fleet"],
        response_model=NodeViewPage,
        summary="nodes with health, lemon score and GPUs",
    )
    async def list_nodes(
        gw: Gw,
        _: Operator,
        cluster: ClusterQ = None,
        limit: Limit = DEFAULT_LIMIT,
        cursor: Cursor = None,
    ) -> NodeViewPage:
        raw, _n = items_of(
            await gw.call("detector", "node_list", {"cluster": cluster}), "detector", "node_list"
        )
        nodes = parse_list(NodeView, raw, "detector", "node_list")
        items, nxt = page_locally(nodes, limit, cursor)
        return NodeViewPage(items=items, next_cursor=nxt)

    @app.get(f"{v1}/nodes/{{node}}", tags=["fleet"], response_model=NodeView, summary="one node")
    async def get_node(gw: Gw, _: Operator, node: NodeName) -> NodeView:
        return await gw.fetch(
            NodeView,
            "detector",
            "node_get",
            {"node": node},
            missing=not_found("node", node, "node"),
        )

    @app.post(
        f"{v1}/nodes/{{node}}/drain",
        tags=["fleet"],
        status_code=202,
        response_model=DrainAccepted,
        summary="planned maintenance: move every rank off the node at a step boundary",
        responses={404: {"description": "no node of that name is known to the detector"}},
    )
    async def drain_node(
        gw: Gw, who: Operator, node: NodeName, body: Annotated[DrainRequest | None, Body()] = None
    ) -> DrainAccepted:
        cluster = body.cluster if body else None
        reason = body.reason if body else "planned maintenance"
        # The scheduler drains whatever name it is given (a node without ranks drains at
        # once): the detector, which knows every node that reported, says whether it exists.
        await gw.call(
            "detector",
            "node_get",
            {"node": node, "cluster": cluster},
            missing=not_found("node", node, "node"),
        )
        result = await gw.call(
            "scheduler",
            "drain",
            {
                "node": node,
                "cluster": cluster,
                "reason": reason,
                "requested_by": f"operator:{who.token_id}",
            },
            missing=not_found("node", node, "node"),
        )
        if isinstance(result, dict) and isinstance(result.get("cluster"), str):
            cluster = cluster or result["cluster"]
        return DrainAccepted(node=node, cluster=cluster, result=result)

    @app.post(
        f"{v1}/nodes/{{node}}/return",
        tags=["fleet"],
        response_model=NodeReturned,
        summary="back to service: detector health reset and spare slots returned",
    )
    async def return_node(gw: Gw, _: Operator, node: NodeName) -> NodeReturned:
        detector = await gw.call(
            "detector", "node_return", {"node": node}, missing=not_found("node", node, "node")
        )
        try:
            pool = await gw.call("spare_pool", "return", {"node": node})
        except ApiProblem as exc:
            # A node that holds no spare slots has nothing to return to the pool.
            if exc.status != 404:
                raise
            pool = None
        return NodeReturned(node=node, detector=detector, spare_pool=pool)

    @app.get(
        f"{v1}/spares", tags=["spares"], response_model=SpareSlotPage, summary="spare inventory"
    )
    async def list_spares(
        gw: Gw,
        _: Operator,
        cluster: ClusterQ = None,
        state: SpareState | None = None,
        limit: Limit = DEFAULT_LIMIT,
        cursor: SpareCursor = None,
    ) -> SpareSlotPage:
        data = await gw.call(
            "spare_pool",
            "list",
            {
                "cluster": cluster,
                "state": state.value if state else None,
                "limit": limit,
                "cursor": cursor,
            },
        )
        raw, nxt = items_of(data, "spare_pool", "list")
        slots = parse_list(SpareSlot, raw, "spare_pool", "list")
        if isinstance(data, list):  # a pool that answers a bare list: paged here by offset
            slots, nxt = page_locally(slots, limit, cursor)
        return SpareSlotPage(items=slots, next_cursor=nxt)

    @app.post(
        f"{v1}/spares",
        tags=["spares"],
        status_code=201,
        response_model=SpareSlot,
        summary="register a spare slot",
    )
    async def register_spare(gw: Gw, _: Operator, body: SpareRegistration) -> SpareSlot:
        result = await gw.call("spare_pool", "register", body.to_slot())
        # The pool answers {slot, previous_state}; a bare slot is accepted too.
        slot = result.get("slot", result) if isinstance(result, dict) else result
        return parse(SpareSlot, slot, "spare_pool", "register")

    @app.get(
        f"{v1}/spares/depth",
        tags=["spares"],
        response_model=SpareDepthPage,
        summary="spares available per NVLink domain, against its floor",
    )
    async def spare_depth(
        gw: Gw,
        _: Operator,
        cluster: ClusterQ = None,
        limit: Limit = DEFAULT_LIMIT,
        cursor: Cursor = None,
    ) -> SpareDepthPage:
        raw, _n = items_of(
            await gw.call("spare_pool", "depth", {"cluster": cluster}), "spare_pool", "depth"
        )
        depth = parse_list(SpareDepth, raw, "spare_pool", "depth")
        items, nxt = page_locally(depth, limit, cursor)
        return SpareDepthPage(items=items, next_cursor=nxt)

    @app.get(
        f"{v1}/spares/{{slot_id}}",
        tags=["spares"],
        response_model=SpareSlot,
        summary="one spare slot",
    )
    async def get_spare(gw: Gw, _: Operator, slot_id: ObjectId) -> SpareSlot:
        return await gw.fetch(
            SpareSlot,
            "spare_pool",
            "get",
            {"slot_id": slot_id},
            missing=not_found("spare slot", slot_id, "slot_id"),
        )

    # ----------------------------------------------------------------- jobs

    @app.get(
        f"{v1}/jobs",
        tags=["jobs"],
        response_model=JobViewPage,
        summary="jobs (a tenant token sees its own)",
    )
    async def list_jobs(
        gw: Gw,
        who: Who,
        tenant: TenantQ = None,
        limit: Limit = DEFAULT_LIMIT,
        cursor: Cursor = None,
    ) -> JobViewPage:
        tenant, visible = tenant_filter(who, tenant)
        if not visible:
            return JobViewPage(items=[], next_cursor=None)
        data = await gw.call(
            "scheduler", "job_list", {"tenant": tenant, "limit": limit, "cursor": cursor}
        )
        raw, nxt = items_of(data, "scheduler", "job_list")
        jobs = owned(parse_list(JobView, raw, "scheduler", "job_list"), who)
        return JobViewPage(items=jobs, next_cursor=nxt)

    async def _job(gw: Gateway, who: Principal, job_id: str) -> JobView:
        missing = not_found("job", job_id, "job_id")
        job = await gw.fetch(JobView, "scheduler", "job_get", {"job_id": job_id}, missing=missing)
        if not who.sees(job.tenant):
            raise missing
        return job

    @app.get(f"{v1}/jobs/{{job_id}}", tags=["jobs"], response_model=JobView, summary="one job")
    async def get_job(gw: Gw, who: Who, job_id: JobId) -> JobView:
        return await _job(gw, who, job_id)

    @app.get(
        f"{v1}/jobs/{{job_id}}/timeline",
        tags=["jobs"],
        response_model=Timeline,
        summary="generations, incidents and migrations of a job, in order",
    )
    async def job_timeline(gw: Gw, who: Who, job_id: JobId) -> Timeline:
        if not who.is_operator:
            await _job(gw, who, job_id)  # the same 404 for another tenant's job
        data = await gw.call(
            "scheduler",
            "job_timeline",
            {"job_id": job_id},
            missing=not_found("job", job_id, "job_id"),
        )
        timeline = parse(Timeline, data, "scheduler", "job_timeline")
        if not who.sees(timeline.tenant):
            raise not_found("job", job_id, "job_id")
        return timeline

    # ----------------------------------------------------------------- incidents

    @app.get(
        f"{v1}/incidents",
        tags=["incidents"],
        response_model=IncidentPage,
        summary="incidents, newest first (a tenant token sees its own)",
        responses={
            422: {
                "description": "`from`/`to` are not date-times as described, `to` is before "
                "`from`, or `cursor` is not an offset"
            }
        },
    )
    async def list_incidents(
        request: Request,
        gw: Gw,
        who: Who,
        lists: Lists,
        job_id: Annotated[str | None, Query(pattern=TOKEN_PATTERN, max_length=128)] = None,
        tenant: TenantQ = None,
        resolution: Resolution | None = None,
        from_: Annotated[
            Timestamp | None,
            Query(alias="from", description=f"detected at or after: {TIMESTAMP_FORMAT}"),
        ] = None,
        to: Annotated[
            Timestamp | None, Query(description=f"detected at or before: {TIMESTAMP_FORMAT}")
        ] = None,
        limit: Limit = DEFAULT_LIMIT,
        cursor: Cursor = None,
    ) -> Response:
        if from_ is not None and to is not None and to < from_:
            raise invalid("to", "must not be before from")
        tenant, visible = tenant_filter(who, tenant)
        if not visible:
            return _json(IncidentPage(items=[], next_cursor=None))
        query = {
            "job_id": job_id,
            "tenant": tenant,
            "resolution": resolution.value if resolution else None,
            "from": from_.isoformat() if from_ else None,
            "to": to.isoformat() if to else None,
            "limit": limit,
            "cursor": cursor,
        }

        async def answer() -> bytes:
            data = await gw.call("scheduler", "incident_list", query)
            raw, nxt = items_of(data, "scheduler", "incident_list")
            incidents = owned(parse_list(Incident, raw, "scheduler", "incident_list"), who)
            return IncidentPage(items=incidents, next_cursor=nxt).model_dump_json().encode()

        key = incidents_key(who, request.scope.get("query_string", b""))
        return Response(await lists.get(key, answer), media_type="application/json")

    @app.get(
        f"{v1}/incidents/{{incident_id}}",
        tags=["incidents"],
        response_model=Incident,
        summary="one incident",
    )
    async def get_incident(gw: Gw, who: Who, incident_id: ObjectId) -> Incident:
        missing = not_found("incident", incident_id, "incident_id")
        incident = await gw.fetch(
            Incident, "scheduler", "incident_get", {"incident_id": incident_id}, missing=missing
        )
        if not who.sees(incident.tenant):
            raise missing
        return incident

    # ----------------------------------------------------------------- contracts, billing

    @app.post(
        f"{v1}/contracts",
        tags=["billing"],
        status_code=201,
        response_model=Contract,
        summary="create a guarantee contract",
        responses={
            422: {
                "description": f"a field is invalid; term_start and term_end must be "
                f"{TIMESTAMP_FORMAT}"
            }
        },
    )
    async def create_contract(gw: Gw, _: Operator, body: ContractRequest) -> Contract:
        return await gw.fetch(Contract, "billing", "contract_create", body.model_dump(mode="json"))

    @app.get(
        f"{v1}/contracts",
        tags=["billing"],
        response_model=ContractPage,
        summary="contracts (a tenant token sees its own)",
    )
    async def list_contracts(
        gw: Gw,
        who: Who,
        tenant: TenantQ = None,
        limit: Limit = DEFAULT_LIMIT,
        cursor: Cursor = None,
    ) -> ContractPage:
        tenant, visible = tenant_filter(who, tenant)
        if not visible:
            return ContractPage(items=[], next_cursor=None)
        data = await gw.call(
            "billing", "contract_list", {"tenant": tenant, "limit": limit, "cursor": cursor}
        )
        raw, nxt = items_of(data, "billing", "contract_list")
        contracts = owned(parse_list(Contract, raw, "billing", "contract_list"), who)
        if isinstance(data, list):
            contracts, nxt = page_locally(contracts, limit, cursor)
        return ContractPage(items=contracts, next_cursor=nxt)

    async def _contract(gw: Gateway, who: Principal, contract_id: str) -> Contract:
        missing = not_found("contract", contract_id, "contract_id")
        contract = await gw.fetch(
            Contract, "billing", "contract_get", {"contract_id": contract_id}, missing=missing
        )
        if not who.sees(contract.tenant):
            raise missing
        return contract

    @app.get(
        f"{v1}/contracts/{{contract_id}}",
        tags=["billing"],
        response_model=Contract,
        summary="one contract",
    )
    async def get_contract(gw: Gw, who: Who, contract_id: ObjectId) -> Contract:
        return await _contract(gw, who, contract_id)

    @app.get(
        f"{v1}/contracts/{{contract_id}}/guarantee",
        tags=["billing"],
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
            await _contract(gw, who, contract_id)
        return await gw.fetch(
            Guarantee,
            "billing",
            "guarantee",
            {"contract_id": contract_id, "at": at.isoformat() if at else None},
            missing=not_found("contract", contract_id, "contract_id"),
        )

    @app.post(
        f"{v1}/contracts/{{contract_id}}/close-term",
        tags=["billing"],
        response_model=CloseTermResult,
        summary="after term_end: final evaluation, issues the credit once (409 before)",
    )
    async def close_term(gw: Gw, _: Operator, contract_id: ObjectId) -> CloseTermResult:
        return await gw.fetch(
            CloseTermResult,
            "billing",
            "close_term",
            {"contract_id": contract_id},
            missing=not_found("contract", contract_id, "contract_id"),
        )

    @app.get(
        f"{v1}/credits",
        tags=["billing"],
        response_model=CreditViewPage,
        summary="credits issued (a tenant token sees its own)",
    )
    async def list_credits(
        gw: Gw,
        who: Who,
        contract_id: Annotated[str | None, Query(pattern=ID_PATTERN, max_length=128)] = None,
        tenant: TenantQ = None,
        limit: Limit = DEFAULT_LIMIT,
        cursor: Cursor = None,
    ) -> CreditViewPage:
        tenant, visible = tenant_filter(who, tenant)
        if not visible:
            return CreditViewPage(items=[], next_cursor=None)
        data = await gw.call(
            "billing", "credits_list", {"contract_id": contract_id, "tenant": tenant}
        )
        raw, _n = items_of(data, "billing", "credits_list")
        credits_ = owned(parse_list(CreditView, raw, "billing", "credits_list"), who)
        items, nxt = page_locally(credits_, limit, cursor)
        return CreditViewPage(items=items, next_cursor=nxt)

    @app.get(
        f"{v1}/billing/export",
        tags=["billing"],
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
                raise ApiProblem(
                    502,
                    "Bad Gateway",
                    "billing.export answered no CSV body",
                    kind="bad-gateway",
                    service="billing",
                )
            return Response(body, media_type="text/csv; charset=utf-8", headers=disposition)
        if isinstance(body, str):
            try:
                body = json.loads(body)
            except ValueError as exc:
                raise ApiProblem(
                    502,
                    "Bad Gateway",
                    f"billing.export answered bad JSON: {exc}",
                    kind="bad-gateway",
                    service="billing",
                ) from exc
        return JSONResponse(body, headers=disposition)

    @app.get(
        f"{v1}/ledger/verify",
        tags=["billing"],
        response_model=LedgerVerification,
        summary="recompute the ledger's hash chain; first_bad names the first bad entry",
    )
    async def ledger_verify(
        gw: Gw,
        _: Operator,
        contract_id: Annotated[str | None, Query(pattern=ID_PATTERN, max_length=128)] = None,
    ) -> LedgerVerification:
        return await gw.fetch(
            LedgerVerification, "billing", "ledger_verify", {"contract_id": contract_id}
        )


# --------------------------------------------------------------------------- errors


def _problem_response(problem: ApiProblem, request: Request) -> JSONResponse:
    return JSONResponse(
        problem.document(str(request.url.path)),
        status_code=problem.status,
        media_type=PROBLEM_JSON,
        headers=problem.headers,
    )


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiProblem)
    async def on_problem(request: Request, exc: ApiProblem) -> JSONResponse:
        return _problem_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for err in exc.errors()[:20]:
            loc = [str(p) for p in err.get("loc", ())]
            where = loc[0] if loc else "body"
            field = ".".join(loc[1:]) or where
            if err.get("type") == "json_invalid":
                field = "body"
            if where == "query" and field == "from_":
                field = "from"
            errors.append({"field": field, "in": where, "message": str(err.get("msg", ""))})
        first = errors[0] if errors else {"field": "body", "message": "invalid request"}
        detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:5])
        return _problem_response(
            ApiProblem(
                422, "Invalid request", detail, kind="invalid", field=first["field"], errors=errors
            ),
            request,
        )

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        problem = ApiProblem(
            exc.status_code,
            _TITLES.get(exc.status_code, "Error"),
            str(exc.detail),
            kind=f"http-{exc.status_code}",
            headers=dict(exc.headers or {}) or None,
        )
        return _problem_response(problem, request)

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _problem_response(
            ApiProblem(
                500,
                "Internal Server Error",
                f"{type(exc).__name__}; see the api log",
                kind="internal",
            ),
            request,
        )


_TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    415: "Unsupported Media Type",
    422: "Invalid request",
}

_ERROR_STATUSES = {
    "400": "bad request",
    "401": "no or unknown bearer token",
    "403": "an operator route called with a tenant token",
    "404": "no such object (or another tenant's)",
    "409": "conflicts with the current state",
    "413": "the request body is over TORCHRELAY_API_MAX_BODY_BYTES (default 1 MiB): refused "
    "before it is read and before the token is checked; `field` is `body`",
    "422": "invalid input; `field` names it",
    "502": "a service answered with an error or an unexpected shape",
    "503": "the service that owns the data is not answering; `service` names it",
}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document with problem+json errors on every ``/v1`` operation."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
        tags=app.openapi_tags,
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["Problem"] = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
    problem = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
    for path, operations in doc.get("paths", {}).items():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            # FastAPI's own 422 (its validation error shape) is replaced by the problem's.
            if responses.get("422", {}).get("description") == "Validation Error":
                responses.pop("422")
            if path.startswith("/v1/"):
                for status, text in _ERROR_STATUSES.items():
                    # A route's own description of a status says more than the generic one.
                    given = responses.get(status, {}).get("description")
                    responses[status] = {"description": given or text, "content": problem}
            elif path == "/readyz":
                responses["503"] = {
                    "description": "not ready",
                    "content": {"application/json": {"schema": {"type": "object"}}},
                }
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    app.openapi_schema = doc
    return doc


# --------------------------------------------------------------------------- app


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

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
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

    app = _PortalApp(
        title="torchrelay portal API",
        version=__version__,
        lifespan=lifespan,
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
    _add_routes(app)
    _add_error_handlers(app)
    from services.api.ui import add_ui

    add_ui(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.add_middleware(_HttpMetrics, state=st)
    app.kept = KeptAnswers(st)

    def max_body_bytes() -> int:
        return st.settings.max_body_bytes if st.settings is not None else DEFAULT_MAX_BODY_BYTES

    app.body_limit = BodyLimit(app._serve, max_body_bytes)
    return app


def openapi_document() -> dict[str, Any]:
    """The portal API's OpenAPI document (deterministic; ``make proto`` writes it)."""
    return create_app().openapi()
