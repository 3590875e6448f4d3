"""Incidents: the list, newest first, and one incident (a tenant token sees its own).

``GET /v1/incidents`` is the hot path of every dashboard: its answers are kept in the list
cache under :func:`services.api.kept.incidents_key`, and a repeated query of a remembered
token is answered from there in front of FastAPI (:mod:`services.api.kept`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from services.api.deps import Gw, Lists, Who
from services.api.gateway import invalid
from services.api.kept import incidents_key
from services.api.models import TIMESTAMP_FORMAT, Incident, Page, Timestamp
from services.api.routes.common import Listing, Lookup, Paging
from services.api.routes.params import DEFAULT_LIMIT, Cursor, JobIdQ, Limit, ObjectId, TenantQ
from torchrelay.contract import Resolution

router = APIRouter(prefix="/v1", tags=["incidents"])

IncidentPage = Page[Incident]

INCIDENTS = Listing(Incident, "scheduler", "incident_list", Paging.SERVICE)
INCIDENT = Lookup(Incident, "scheduler", "incident_get", "incident", "incident_id")


@router.get(
    "/incidents",
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
    job_id: JobIdQ = None,
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
    query = {
        "job_id": job_id,
        "resolution": resolution.value if resolution else None,
        "from": from_.isoformat() if from_ else None,
        "to": to.isoformat() if to else None,
    }

    async def answer() -> bytes:
        items, nxt = await INCIDENTS.owned_page(gw, who, tenant, limit, cursor, query)
        return IncidentPage(items=items, next_cursor=nxt).model_dump_json().encode()

    # Sent as the kept bytes: FastAPI does not validate an already valid page again.
    key = incidents_key(who, request.scope.get("query_string", b""))
    return Response(await lists.get(key, answer), media_type="application/json")


@router.get("/incidents/{incident_id}", response_model=Incident, summary="one incident")
async def get_incident(gw: Gw, who: Who, incident_id: ObjectId) -> Incident:
    return await INCIDENT.get(gw, incident_id, who)
