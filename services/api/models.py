"""The portal API's request and response models (field names from docs/interfaces.md).

Requests are validated here before anything reaches a service; responses are parsed from the
services' replies so a reply of the wrong shape becomes a 502 naming the service, never a
half-valid document. Response models accept fields the services add later (forward
compatibility) and pass them through.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from torchrelay.contract import Contract, Guarantee, Incident, Name, SpareSlot, Token

T = TypeVar("T")

# Pagination cursors, exactly what the services take: the scheduler's and billing's lists
# (and the lists the API pages itself) take an offset (the services' ``^[0-9]+$``, bounded
# here to nine digits); the spare pool's list takes the last slot_id of the previous page.
CURSOR_PATTERN = r"^[0-9]{1,9}$"
SPARE_CURSOR_PATTERN = r"^[A-Za-z0-9_\-.:/]{1,256}$"
PERIOD_PATTERN = r"^[0-9]{4}-(0[1-9]|1[0-2])$"
# Timestamps and billing periods the API takes: every service can compute with them (a year
# 0 or 10000 is out of Python's datetime range, and a service hitting it answered 502).
MIN_YEAR, MAX_YEAR = 1970, 9998
MIN_TIMESTAMP = datetime(MIN_YEAR, 1, 1, tzinfo=UTC)
MAX_TIMESTAMP = datetime(MAX_YEAR, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
TIMESTAMP_FORMAT = (
    "an RFC 3339 date-time with a UTC offset, e.g. 2026-01-01T00:00:00Z, between "
    f"{MIN_YEAR}-01-01T00:00:00Z and {MAX_YEAR}-12-31T23:59:59Z; numbers (Unix times) "
    "are refused"
)
PERIOD_FORMAT = f"YYYY-MM, a month of the years {MIN_YEAR} to {MAX_YEAR}, e.g. 2026-01"
_DATE_START = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}")


def _timestamp_text(value: Any) -> Any:
    """Refuse what is not written as a date-time: pydantic would take a number (or a string
    of digits) as a Unix time."""
    if isinstance(value, datetime) or (isinstance(value, str) and _DATE_START.match(value)):
        return value
    raise ValueError(f"must be {TIMESTAMP_FORMAT}")


def _timestamp_in_range(value: datetime) -> datetime:
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        utc = None
    if utc is None or not MIN_TIMESTAMP <= utc <= MAX_TIMESTAMP:
        raise ValueError(
            f"is out of range: must be between {MIN_YEAR}-01-01T00:00:00Z and "
            f"{MAX_YEAR}-12-31T23:59:59Z"
        )
    return value


def _period_in_range(value: str) -> str:
    year = int(value[:4]) if value[:4].isdigit() else 0
    if not MIN_YEAR <= year <= MAX_YEAR:
        raise ValueError(f"year {value[:4]} is out of range: must be {PERIOD_FORMAT}")
    return value


# A timestamp of a request: text in RFC 3339 form only, with an offset, in range.
Timestamp = Annotated[
    AwareDatetime,
    BeforeValidator(_timestamp_text),
    AfterValidator(_timestamp_in_range),
    Field(description=TIMESTAMP_FORMAT),
]
# A billing period ``YYYY-MM`` whose month every service can compute with.
Period = Annotated[str, Field(pattern=PERIOD_PATTERN), AfterValidator(_period_in_range)]
# Money is integer minor units; bounded so every consumer can hold it in an int64.
MAX_MINOR = 10**15

Currency = Annotated[str, Field(pattern=r"^[A-Z]{3}$", examples=["USD"])]


class Problem(BaseModel):
    """An RFC 9457 problem document; ``field`` names the offending input when there is one."""

    model_config = ConfigDict(extra="allow")

    type: str = "about:blank"
    title: str
    status: int
    detail: str = ""
    instance: str | None = None
    field: str | None = None
    service: str | None = None
    errors: list[dict[str, Any]] | None = None


class Page(BaseModel, Generic[T]):
    """One page of a list: pass ``next_cursor`` back as ``cursor`` for the next one."""

    items: list[T]
    next_cursor: str | None = None


class Passthrough(BaseModel):
    """Base of response models whose services may add fields: those are passed on."""

    model_config = ConfigDict(extra="allow")


# --------------------------------------------------------------------------- tokens


class TokenRequest(BaseModel):
    """``POST /v1/tokens``: an operator token, or a tenant token bound to one tenant."""

    model_config = ConfigDict(extra="forbid")

    scope: Literal["operator", "tenant"]
    tenant: Token | None = Field(default=None, validate_default=True)

    @field_validator("tenant")
    @classmethod
    def _tenant_matches_scope(cls, value: str | None, info: ValidationInfo) -> str | None:
        scope = info.data.get("scope")
        if scope == "tenant" and value is None:
            raise ValueError("tenant is required for a tenant token")
        if scope == "operator" and value is not None:
            raise ValueError("tenant is only for tenant tokens; an operator sees every tenant")
        return value


class TokenIssued(BaseModel):
    """The new token, shown once: only its hash is kept."""

    token: str
    token_id: str
    scope: Literal["operator", "tenant"]
    tenant: str | None = None


class TokenInfo(BaseModel):
    """A stored token as ``GET /v1/tokens`` lists it: never its secret."""

    token_id: str
    scope: Literal["operator", "tenant"]
    tenant: str | None = None
    created_at: str | None = None
    configured: bool = Field(
        default=False,
        description="the operator token of the API's settings (revoke it by changing them)",
    )


# --------------------------------------------------------------------------- fleet


class ClusterView(Passthrough):
    """A cluster with its node and spare counts."""

    cluster: str
    nodes: int = 0
    gpus: int = 0
    unhealthy: int = 0
    spares_available: int = 0
    spare_domains: int = 0


class NodeView(Passthrough):
    """A node's health as the detector sees it."""

    node: str
    cluster: str
    health: str
    lemon_score: float = 0.0
    state: str = ""
    gpus: list[dict[str, Any]] = Field(default_factory=list)


class DrainRequest(BaseModel):
    """``POST /v1/nodes/{node}/drain`` (the body is optional)."""

    model_config = ConfigDict(extra="forbid")

    cluster: Name | None = None
    reason: Annotated[str, Field(min_length=1, max_length=500)] = "planned maintenance"


class DrainAccepted(BaseModel):
    """The scheduler accepted the drain: ranks leave the node at their next step boundary."""

    node: str
    cluster: str | None = None
    accepted: bool = True
    result: Any = None


class NodeReturned(BaseModel):
    """The node is back in service (detector) and, if it holds spares, back in the pool."""

    node: str
    detector: Any = None
    spare_pool: Any = None


class SpareDepth(Passthrough):
    """How many spares a domain has available against its floor."""

    cluster: str
    nvlink_domain: str
    available: int
    floor: int = 0


class SpareRegistration(BaseModel):
    """``POST /v1/spares``: one spare GPU slot (SpareSlot fields; ``slot_id`` optional)."""

    model_config = ConfigDict(extra="forbid")

    slot_id: Name | None = None
    cluster: Name = "local"
    node: Name
    gpu: int = Field(ge=0, le=1023)
    gpu_model: Annotated[str, Field(min_length=1, max_length=128)] = "cpu-sim"
    memory_mb: int = Field(default=0, ge=0, le=10**9)
    nvlink_domain: Name = "default"
    rack: Name = "default"
    zone: Name = "default"

    def to_slot(self) -> dict[str, Any]:
        """The spare-pool ``register`` payload (the pool derives ``slot_id`` when absent)."""
        return self.model_dump(mode="json", exclude_none=True)


# --------------------------------------------------------------------------- jobs


class RankView(Passthrough):
    rank: int
    node: str
    gpu: int
    pid: int | None = None


class JobView(Passthrough):
    """A job as the scheduler sees it."""

    job_id: str
    tenant: str
    world_size: int
    spares: int = 0
    generation: int = 0
    committed_step: int | None = None
    state: str
    ranks: list[RankView] = Field(default_factory=list)


class TimelineEntry(Passthrough):
    """One event of a job's life: a generation, a fault, a migration step (``type`` says)."""

    type: str
    at: datetime | None = None


class Timeline(Passthrough):
    """A job's generations, incidents and migrations, each list in time order."""

    job_id: str
    tenant: str | None = None
    events: list[TimelineEntry] = Field(default_factory=list)
    generations: list[dict[str, Any]] = Field(default_factory=list)
    incidents: list[Incident] = Field(default_factory=list)
    migrations: list[dict[str, Any]] = Field(default_factory=list)


# --------------------------------------------------------------------------- billing


class ContractRequest(BaseModel):
    """``POST /v1/contracts``: a contract without its id (money in minor units)."""

    model_config = ConfigDict(extra="forbid")

    contract_id: Name | None = None
    tenant: Token
    term_start: Timestamp
    term_end: Timestamp
    renewal_fee_minor: int = Field(ge=0, le=MAX_MINOR)
    currency: Currency
    threshold: float = Field(default=0.9, gt=0, le=1)
    credit_rate: float = Field(default=0.25, ge=0, le=1)
    count_proactive: bool = False
    price_per_gpu_hour_minor: int | None = Field(
        default=None,
        ge=0,
        le=MAX_MINOR,
        description="what a GPU-hour costs the tenant (minor units); prices goodput's savings",
    )

    @field_validator("term_end")
    @classmethod
    def _term_is_forward(cls, value: datetime, info: ValidationInfo) -> datetime:
        start = info.data.get("term_start")
        if start is not None and value <= start:
            raise ValueError("term_end must be after term_start")
        return value


class CreditView(Passthrough):
    """A credit issued for a term whose guarantee was missed."""

    credit_id: str
    contract_id: str
    tenant: str
    amount_minor: int
    currency: str
    term_start: datetime | None = None
    term_end: datetime | None = None
    eligible_failures: int | None = None
    resolved_by_migration: int | None = None
    ratio: float | None = None


class CloseTermResult(Passthrough):
    """A closed term: the final guarantee and, when it was missed, the one credit."""

    guarantee: Guarantee
    credit: CreditView | None = None
    closed_now: bool = False


class GoodputIncident(Passthrough):
    """One incident's lost GPU time and its cost under checkpoint restart."""

    incident_id: str
    resolution: str
    world_size: int
    stall_ms: float | None = None
    lost_steps: int | None = None
    stall_gpu_seconds: float
    lost_steps_gpu_seconds: float
    gpu_seconds_lost: float
    counterfactual_gpu_seconds: float


class Counterfactual(Passthrough):
    """The same failures under checkpoint restart, and what torchrelay saved against it."""

    policy: str = "checkpoint_restart"
    checkpoint_every: int | None = None
    restart_s: float
    gpu_seconds_lost: float
    gpu_seconds_saved: float
    gpu_hours_saved: float
    price_per_gpu_hour_minor: int | None = None
    money_saved_minor: int | None = None
    currency: str | None = None


class GoodputFigures(Passthrough):
    """allocated = progress + lost (GPU-seconds); ETTR = progress / allocated."""

    gpu_seconds_allocated: float
    gpu_seconds_progress: float
    gpu_seconds_lost: float
    ettr: float | None = None
    counterfactual: Counterfactual


class JobGoodput(GoodputFigures):
    """A job's goodput, each incident's share of the lost time listed."""

    job_id: str
    tenant: str
    state: str | None = None
    world_size: int | None = None
    committed_step: int | None = None
    step_time_s: float | None = None
    start: datetime | None = None
    end: datetime | None = None
    incidents: list[GoodputIncident] = Field(default_factory=list)


class TenantGoodput(GoodputFigures):
    """A tenant's goodput in a window: the sum, each job's, and each contract term's."""

    tenant: str
    incidents: int = 0
    jobs: list[dict[str, Any]] = Field(default_factory=list)
    terms: list[dict[str, Any]] = Field(default_factory=list)


class LedgerVerification(Passthrough):
    """The ledger's hash chain recomputed: ``first_bad`` names the first entry that differs."""

    ok: bool
    checked: int
    first_bad: Any = None


__all__ = [
    "CURSOR_PATTERN",
    "MAX_MINOR",
    "PERIOD_FORMAT",
    "PERIOD_PATTERN",
    "SPARE_CURSOR_PATTERN",
    "TIMESTAMP_FORMAT",
    "CloseTermResult",
    "ClusterView",
    "Contract",
    "ContractRequest",
    "Counterfactual",
    "CreditView",
    "DrainAccepted",
    "DrainRequest",
    "GoodputFigures",
    "GoodputIncident",
    "Guarantee",
    "Incident",
    "JobGoodput",
    "JobView",
    "LedgerVerification",
    "NodeReturned",
    "NodeView",
    "Page",
    "Period",
    "Problem",
    "RankView",
    "SpareDepth",
    "SpareRegistration",
    "SpareSlot",
    "TenantGoodput",
    "Timeline",
    "TimelineEntry",
    "Timestamp",
    "TokenIssued",
    "TokenRequest",
]
