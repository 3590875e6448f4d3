"""Goodput: how much of a job's allocated GPU time became committed training progress.

Pure arithmetic (no torch, no servers): the scheduler feeds it a job's generations, its
incidents and the agents' step time; the API, the dashboard and ``torchrelay demo`` show
what it answers. docs/design.md §14 says what each figure means; in short, for a window of
a job's life:

- allocated: the world size of each generation times the time it ran, from generation 1
  (every rank joined) to the job's end (or now);
- each incident's lost time: the world size when it struck times its stall (the job made no
  progress), plus its lost steps times the agents' step time times that world size (the
  steps done again). Stalls that overlap count once, on the incident detected first;
- progress: every allocated GPU-second no incident lost, so that
  ``allocated = progress + sum(incident lost)`` holds exactly (to the millisecond);
- ETTR: progress / allocated;
- the counterfactual: the same incidents had the job restarted from a checkpoint taken every
  ``checkpoint_every`` steps, each restart taking ``restart_s``: a failure loses on average
  half an interval of steps plus the restart; a planned drain (``migrated_proactive``) only
  the restart. What it would have cost beyond what it did is the GPU time saved, priced at
  ``price_per_gpu_hour_minor``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from fractions import Fraction
from typing import Any

# Resolutions a checkpoint restart would have replaced: a failure torchrelay resolved
# without rolling the job back.
_ROLLED_BACK_UNDER_RESTART = ("migrated_live", "shrunk", "lost", "manual")
_DRAINED = "migrated_proactive"
MS = 3  # figures are rounded to the millisecond, and add up after rounding


@dataclass(frozen=True)
class GenerationSpan:
    """A generation of the job: from ``start``, ``world_size`` ranks."""

    generation: int
    start: datetime
    world_size: int


@dataclass(frozen=True)
class IncidentFacts:
    """What goodput needs of one incident (the ledger's and the scheduler's fields)."""

    incident_id: str
    resolution: str
    detected_at: datetime
    stall_ms: float | None = None
    lost_steps: int | None = None
    generation_before: int | None = None

    @classmethod
    def of(cls, incident: dict[str, Any]) -> IncidentFacts:
        """From an Incident's JSON (``Incident.model_dump(mode="json")``)."""
        return cls(
            incident_id=str(incident["incident_id"]),
            resolution=str(incident["resolution"]),
            detected_at=_instant(incident["detected_at"]),
            stall_ms=incident.get("stall_ms"),
            lost_steps=incident.get("lost_steps"),
            generation_before=incident.get("generation_before"),
        )


@dataclass(frozen=True)
class Assumptions:
    """The counterfactual's settings: checkpoint interval, restart time and price."""

    checkpoint_every: int
    restart_s: float
    price_per_gpu_hour_minor: int | None = None
    currency: str | None = None


@dataclass(frozen=True)
class JobFacts:
    """A job as the scheduler's registry holds it."""

    job_id: str
    tenant: str
    generations: tuple[GenerationSpan, ...]
    end: datetime  # finished_at, or now for a job still running
    committed_step: int | None = None
    step_time_s: float | None = None  # the agents' mean step time (heartbeats)
    checkpoint_every: int | None = None  # the job's own interval, when it checkpoints


@dataclass
class IncidentCost:
    """One incident's lost GPU time, and what checkpoint restart would have cost."""

    incident_id: str
    resolution: str
    detected_at: datetime
    world_size: int
    stall_ms: float | None
    lost_steps: int | None
    stall_gpu_seconds: float
    lost_steps_gpu_seconds: float
    gpu_seconds_lost: float
    counterfactual_gpu_seconds: float

    def as_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "incident_id": self.incident_id,
            "resolution": self.resolution,
            "detected_at": self.detected_at.isoformat(),
            "world_size": self.world_size,
            "stall_ms": self.stall_ms,
            "lost_steps": self.lost_steps,
            "stall_gpu_seconds": self.stall_gpu_seconds,
            "lost_steps_gpu_seconds": self.lost_steps_gpu_seconds,
            "gpu_seconds_lost": self.gpu_seconds_lost,
            "counterfactual_gpu_seconds": self.counterfactual_gpu_seconds,
        }


@dataclass
class Goodput:
    """The goodput of a job (or the sum over several) in a window."""

    gpu_seconds_allocated: float = 0.0
    gpu_seconds_progress: float = 0.0
    gpu_seconds_lost: float = 0.0
    counterfactual_gpu_seconds_lost: float = 0.0
    incidents: list[IncidentCost] = field(default_factory=list)

    @property
    def ettr(self) -> float | None:
        """Effective training time ratio: progress / allocated (None when nothing ran)."""
        if self.gpu_seconds_allocated <= 0:
            return None
        return round(self.gpu_seconds_progress / self.gpu_seconds_allocated, 6)

    @property
    def gpu_seconds_saved(self) -> float:
        """What checkpoint restart would have lost beyond what was lost."""
        return round(self.counterfactual_gpu_seconds_lost - self.gpu_seconds_lost, MS)

    def add(self, other: Goodput) -> None:
        """Sum ``other`` into this one (a tenant's jobs, a term's)."""
        self.gpu_seconds_allocated = round(
            self.gpu_seconds_allocated + other.gpu_seconds_allocated, MS
        )
        self.gpu_seconds_progress = round(
            self.gpu_seconds_progress + other.gpu_seconds_progress, MS
        )
        self.gpu_seconds_lost = round(self.gpu_seconds_lost + other.gpu_seconds_lost, MS)
        self.counterfactual_gpu_seconds_lost = round(
            self.counterfactual_gpu_seconds_lost + other.counterfactual_gpu_seconds_lost, MS
        )
        self.incidents.extend(other.incidents)

    def summary(self, assumptions: Assumptions) -> dict[str, Any]:
        """The JSON figures (docs/interfaces.md, goodput), incidents included."""
        saved = self.gpu_seconds_saved
        price = assumptions.price_per_gpu_hour_minor
        return {
            "gpu_seconds_allocated": self.gpu_seconds_allocated,
            "gpu_seconds_progress": self.gpu_seconds_progress,
            "gpu_seconds_lost": self.gpu_seconds_lost,
            "ettr": self.ettr,
            "incidents": [i.as_dict() for i in self.incidents],
            "counterfactual": {
                "policy": "checkpoint_restart",
                "checkpoint_every": assumptions.checkpoint_every,
                "restart_s": assumptions.restart_s,
                "gpu_seconds_lost": self.counterfactual_gpu_seconds_lost,
                "gpu_seconds_saved": saved,
                "gpu_hours_saved": round(saved / 3600.0, 6),
                "price_per_gpu_hour_minor": price,
                "money_saved_minor": None if price is None else money_minor(saved, price),
                "currency": assumptions.currency,
            },
        }


def money_minor(gpu_seconds: float, price_per_gpu_hour_minor: int) -> int:
    """``gpu_seconds`` priced per GPU-hour, in minor units, rounded half away from zero.

    The seconds are read as the decimal they were written as (milliseconds), so the
    rounding is exact: 1800 s at 3 minor units an hour is 1.5, which rounds to 2.
    """
    amount = Fraction(repr(gpu_seconds)) * price_per_gpu_hour_minor / 3600
    sign = -1 if amount < 0 else 1
    return sign * int(abs(amount) + Fraction(1, 2))


def price_for(
    asked: int | None,
    asked_currency: str | None,
    contract_price: int | None,
    contract_currency: str | None,
) -> tuple[int | None, str | None]:
    """The price of a GPU-hour goodput uses, and its currency: the one asked for; else the
    contract's, in its currency, unless another currency was asked; else none (the
    operator's default then applies)."""
    if asked is not None:
        return asked, asked_currency
    if contract_price is not None and asked_currency in (None, contract_currency):
        return contract_price, contract_currency
    return None, asked_currency


def term_window(
    term_start: datetime, term_end: datetime, since: datetime | None, until: datetime | None
) -> tuple[datetime, datetime] | None:
    """The part of a contract term inside ``[since, until)`` (None: they do not meet)."""
    lo = term_start if since is None else max(term_start, since)
    hi = term_end if until is None else min(term_end, until)
    return (lo, hi) if lo < hi else None


def allocated_gpu_seconds(
    generations: tuple[GenerationSpan, ...], start: datetime, end: datetime
) -> float:
    """World size times running time of each generation, inside ``[start, end)``."""
    spans = sorted(generations, key=lambda g: g.generation)
    total = 0.0
    for i, gen in enumerate(spans):
        gen_end = spans[i + 1].start if i + 1 < len(spans) else end
        lo, hi = max(gen.start, start), min(gen_end, end)
        if hi > lo:
            total += gen.world_size * (hi - lo).total_seconds()
    return total


def world_size_at(generations: tuple[GenerationSpan, ...], incident: IncidentFacts) -> int:
    """The world size the incident struck: its ``generation_before``, else the generation
    running at its detection."""
    by_number = {g.generation: g.world_size for g in generations}
    if incident.generation_before in by_number:
        return by_number[incident.generation_before]
    running = [g for g in generations if g.start <= incident.detected_at]
    if running:
        return max(running, key=lambda g: g.generation).world_size
    return 0  # struck before generation 1: nothing was allocated yet


def job_goodput(
    job: JobFacts,
    incidents: list[IncidentFacts],
    assumptions: Assumptions,
    since: datetime | None = None,
    until: datetime | None = None,
) -> Goodput:
    """The goodput of ``job`` in ``[since, until)`` (its whole life when not given).

    An incident counts in the window where it was detected; its stall is cut to the window
    and to the job's allocation, and a stall overlapping an earlier incident's counts once.

    Args:
        job: the job's generations, end, committed step and step time.
        incidents: its incidents (any order).
        assumptions: the counterfactual's checkpoint interval, restart time and price.
        since: the window's start.
        until: the window's end.
    """
    if not job.generations:
        return Goodput()
    first = min(g.start for g in job.generations)
    start = max(first, since) if since else first
    end = min(job.end, until) if until else job.end
    if end <= start:
        return Goodput()
    allocated = round(allocated_gpu_seconds(job.generations, start, end), MS)
    step_time = job.step_time_s or 0.0
    half_interval = assumptions.checkpoint_every / 2.0
    covered_until = start
    costs: list[IncidentCost] = []
    for inc in sorted(incidents, key=lambda i: (i.detected_at, i.incident_id)):
        if not start <= inc.detected_at < end:
            continue
        n = world_size_at(job.generations, inc)
        stall_s = (inc.stall_ms or 0.0) / 1000.0
        stall_from = max(inc.detected_at, covered_until)
        stall_to = min(inc.detected_at + timedelta(seconds=stall_s), end)
        own_stall = max(0.0, (stall_to - stall_from).total_seconds())
        covered_until = max(covered_until, stall_to)
        stall_gpu = round(n * own_stall, MS)
        steps_gpu = round(n * (inc.lost_steps or 0) * step_time, MS)
        lost = round(stall_gpu + steps_gpu, MS)
        if inc.resolution in _ROLLED_BACK_UNDER_RESTART:
            counterfactual = round(n * (assumptions.restart_s + half_interval * step_time), MS)
        elif inc.resolution == _DRAINED:
            counterfactual = round(n * assumptions.restart_s, MS)
        else:  # it was a restart, or no policy would have changed it (application errors)
            counterfactual = lost
        costs.append(
            IncidentCost(
                incident_id=inc.incident_id,
                resolution=inc.resolution,
                detected_at=inc.detected_at,
                world_size=n,
                stall_ms=inc.stall_ms,
                lost_steps=inc.lost_steps,
                stall_gpu_seconds=stall_gpu,
                lost_steps_gpu_seconds=steps_gpu,
                gpu_seconds_lost=lost,
                counterfactual_gpu_seconds=counterfactual,
            )
        )
    lost_total = round(sum(c.gpu_seconds_lost for c in costs), MS)
    return Goodput(
        gpu_seconds_allocated=allocated,
        gpu_seconds_progress=round(allocated - lost_total, MS),
        gpu_seconds_lost=lost_total,
        counterfactual_gpu_seconds_lost=round(sum(c.counterfactual_gpu_seconds for c in costs), MS),
        incidents=costs,
    )


def _instant(value: Any) -> datetime:
    if isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
