"""Jobs: the list, one job and its timeline (a tenant token sees its own)."""

from __future__ import annotations

from fastapi import APIRouter

from services.api.deps import Gw, Who
from services.api.gateway import parse
from services.api.models import JobView, Page, Timeline
from services.api.routes.common import Listing, Lookup, Paging
from services.api.routes.params import DEFAULT_LIMIT, Cursor, JobId, Limit, TenantQ

router = APIRouter(prefix="/v1", tags=["jobs"])

JobViewPage = Page[JobView]

JOBS = Listing(JobView, "scheduler", "job_list", Paging.SERVICE)
JOB = Lookup(JobView, "scheduler", "job_get", "job", "job_id")


@router.get("/jobs", response_model=JobViewPage, summary="jobs (a tenant token sees its own)")
async def list_jobs(
    gw: Gw,
    who: Who,
    tenant: TenantQ = None,
    limit: Limit = DEFAULT_LIMIT,
    cursor: Cursor = None,
) -> JobViewPage:
    items, nxt = await JOBS.owned_page(gw, who, tenant, limit, cursor)
    return JobViewPage(items=items, next_cursor=nxt)


@router.get("/jobs/{job_id}", response_model=JobView, summary="one job")
async def get_job(gw: Gw, who: Who, job_id: JobId) -> JobView:
    return await JOB.get(gw, job_id, who)


@router.get(
    "/jobs/{job_id}/timeline",
    response_model=Timeline,
    summary="generations, incidents and migrations of a job, in order",
)
async def job_timeline(gw: Gw, who: Who, job_id: JobId) -> Timeline:
    if not who.is_operator:
        await JOB.get(gw, job_id, who)  # the same 404 for another tenant's job
    data = await gw.call(
        "scheduler", "job_timeline", {"job_id": job_id}, missing=JOB.missing(job_id)
    )
    timeline = parse(Timeline, data, "scheduler", "job_timeline")
    if not who.sees(timeline.tenant):
        raise JOB.missing(job_id)
    return timeline
