"""The scheduler's goodput verbs: a job's figures and a tenant's, from the registry, the
incidents and the agents' step times (the arithmetic is ``torchrelay.goodput``;
docs/design.md §14)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from torchrelay.bus import NotFound
from torchrelay.contract import Token, utcnow
from torchrelay.goodput import (
    Assumptions,
    GenerationSpan,
    Goodput,
    IncidentFacts,
    JobFacts,
    job_goodput,
)

from .incidents import IncidentStore
from .registry import JobRegistry


class GoodputQuery(BaseModel):
    """The counterfactual's settings, as the API passes them (docs/design.md §14)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    # The interval to price restarts at; None: the job's own, else the default.
    checkpoint_every: int | None = Field(default=None, ge=1, le=10**9)
    default_checkpoint_every: int = Field(default=1000, ge=1, le=10**9)
    restart_s: float = Field(default=300.0, ge=0, le=10**7)
    price_per_gpu_hour_minor: int | None = Field(default=None, ge=0, le=10**15)
    currency: str | None = Field(default=None, pattern=r"^[A-Z]{3}$")
    since: datetime | None = Field(default=None, alias="from")
    until: datetime | None = Field(default=None, alias="to")


class JobGoodputQuery(GoodputQuery):
    job_id: Token


class TenantGoodputQuery(GoodputQuery):
    tenant: Token


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat()


class GoodputVerbs:
    """``job_goodput`` and ``tenant_goodput`` over the scheduler's Redis state."""

    def __init__(self, jobs: JobRegistry, incidents: IncidentStore) -> None:
        self.jobs = jobs
        self.incidents = incidents

    async def _job_facts(self, job_id: str) -> tuple[dict[str, Any], JobFacts] | None:
        view = await self.jobs.view(job_id)
        job = await self.jobs.get(job_id)
        if view is None or job is None:
            return None
        spans = tuple(
            GenerationSpan(int(g["generation"]), datetime.fromisoformat(g["at"]), len(g["ranks"]))
            for g in await self.jobs.generations(job_id)
        )
        finished = job.get("finished_at")
        facts = JobFacts(
            job_id=job_id,
            tenant=str(job["tenant"]),
            generations=spans,
            end=datetime.fromisoformat(finished) if finished else utcnow(),
            committed_step=view["committed_step"],
            step_time_s=await self.jobs.step_time(job_id),
            checkpoint_every=job.get("checkpoint_every"),
        )
        return view, facts

    async def _goodput_of(
        self, facts: JobFacts, query: GoodputQuery
    ) -> tuple[Goodput, Assumptions]:
        assumptions = Assumptions(
            checkpoint_every=query.checkpoint_every
            or facts.checkpoint_every
            or query.default_checkpoint_every,
            restart_s=query.restart_s,
            price_per_gpu_hour_minor=query.price_per_gpu_hour_minor,
            currency=query.currency,
        )
        incidents, _ = await self.incidents.query(job_id=facts.job_id)
        figures = job_goodput(
            facts,
            [IncidentFacts.of(i.model_dump(mode="json")) for i in incidents],
            assumptions,
            query.since,
            query.until,
        )
        return figures, assumptions

    async def job_goodput(self, body: dict[str, Any]) -> dict[str, Any]:
        """A job's goodput: allocated, progress, each incident's lost time, ETTR and the
        checkpoint-restart counterfactual (docs/design.md §14)."""
        query = JobGoodputQuery.model_validate(body)
        found = await self._job_facts(query.job_id)
        if found is None:
            raise NotFound(f"job {query.job_id} is not registered", "job_id")
        view, facts = found
        figures, assumptions = await self._goodput_of(facts, query)
        return {
            "job_id": query.job_id,
            "tenant": facts.tenant,
            "state": view["state"],
            "world_size": view["world_size"],
            "generation": view["generation"],
            "committed_step": facts.committed_step,
            "step_time_s": facts.step_time_s,
            "start": _iso(min((g.start for g in facts.generations), default=None)),
            "end": _iso(facts.end),
            **figures.summary(assumptions),
        }

    async def tenant_goodput(self, body: dict[str, Any]) -> dict[str, Any]:
        """A tenant's goodput in ``[from, to)``: its jobs' figures, and their sum."""
        query = TenantGoodputQuery.model_validate(body)
        total = Goodput()
        jobs = []
        for job_id in await self.jobs.list_ids():
            found = await self._job_facts(job_id)
            if found is None or found[1].tenant != query.tenant:
                continue
            figures, assumptions = await self._goodput_of(found[1], query)
            if figures.gpu_seconds_allocated <= 0 and not figures.incidents:
                continue  # it did not run in the window
            summary = figures.summary(assumptions)
            del summary["incidents"]
            jobs.append({"job_id": job_id, **summary, "incidents": len(figures.incidents)})
            total.add(figures)
        summed = total.summary(
            Assumptions(
                checkpoint_every=query.checkpoint_every or query.default_checkpoint_every,
                restart_s=query.restart_s,
                price_per_gpu_hour_minor=query.price_per_gpu_hour_minor,
                currency=query.currency,
            )
        )
        # Each job's restarts are priced at its own interval: the sum says only what is summed.
        summed["counterfactual"]["checkpoint_every"] = query.checkpoint_every
        del summed["incidents"]
        return {
            "tenant": query.tenant,
            "from": _iso(query.since),
            "to": _iso(query.until),
            **summed,
            "incidents": len(total.incidents),
            "jobs": jobs,
        }
