"""The spare pool's business rules as pure functions: requests, locality order, floors.

The reservation itself runs as one Lua script inside Redis (``lua/reserve.lua``); the functions
here are the reference the script is tested against, and the validation every request goes
through before it reaches Redis.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from torchrelay.contract import Generation, Heartbeat, Name, SpareSlot, SpareState, Token

# Candidate order of a reservation, best first (docs/design.md §6).
TIERS: tuple[str, ...] = ("hot", "nvlink_domain", "rack", "zone", "any")

# States a slot may be registered in; the others are reached only through transitions.
REGISTRABLE_STATES = frozenset({SpareState.IDLE, SpareState.HOT})

# Node health reported by the detector that keeps a node's slots out of every reservation.
EXCLUDING_HEALTH = frozenset({"unhealthy", "quarantined", "lemon"})

DEFAULT_LEASE_S = 30.0
MAX_LEASE_S = 3600.0
MAX_LIST_LIMIT = 1000

_SLOT_ID = re.compile(r"^[A-Za-z0-9_\-.:/]{1,256}$")


# --------------------------------------------------------------------------- requests


class _Request(BaseModel):
    # Readers accept unknown fields (the contract's rule) and reject invalid ones.
    model_config = ConfigDict(extra="ignore", frozen=True)


class ReserveRequest(_Request):
    """``reserve``: the best spare for ``job_id`` in ``cluster``, as a lease."""

    job_id: Token
    cluster: Name = "local"
    near_node: Name | None = None
    gpu_model: str | None = Field(default=None, min_length=1, max_length=128)
    min_memory_mb: int = Field(default=0, ge=0)
    lease_s: float = Field(default=DEFAULT_LEASE_S, gt=0, le=MAX_LEASE_S)
    # A retried reservation with the same request_id gets the same lease back.
    request_id: Token | None = None


class LeaseRequest(_Request):
    """``confirm``: the lease to turn into a slot in use."""

    lease_id: Token


class ReleaseRequest(_Request):
    """``release``: give a leased slot back to the state it had before."""

    lease_id: Token
    reason: str = Field(default="released", min_length=1, max_length=512)


class ListRequest(_Request):
    """``list``: one page of the inventory."""

    cluster: Name | None = None
    state: SpareState | None = None
    limit: int = Field(default=100, ge=1, le=MAX_LIST_LIMIT)
    cursor: str | None = Field(default=None, max_length=256)


class GetRequest(_Request):
    """``get``: one slot with its transition history."""

    slot_id: str = Field(min_length=1, max_length=256)


class QuarantineRequest(_Request):
    """``quarantine``: take a node's slots (or one GPU's) out of service."""

    node: Name
    gpu: int | None = Field(default=None, ge=0)
    cluster: Name | None = None
    reason: str = Field(min_length=1, max_length=512)
    rma: bool = False


class ReturnRequest(_Request):
    """``return``: put a quarantined node's slots (or one GPU's) back into service."""

    node: Name
    gpu: int | None = Field(default=None, ge=0)
    cluster: Name | None = None
    reason: str = Field(default="returned to service", min_length=1, max_length=512)


class DepthRequest(_Request):
    """``depth``: available spares per NVLink domain."""

    cluster: Name | None = None


def default_slot_id(cluster: str, node: str, gpu: int) -> str:
    """The slot id the launcher and operators use: ``cluster:node:gpu``."""
    return f"{cluster}:{node}:{gpu}"


def registration_problem(slot: SpareSlot) -> tuple[str, str] | None:
    """Why a registration is refused, as ``(field, message)``; None when it is acceptable."""
    if not _SLOT_ID.match(slot.slot_id):
        return (
            "slot_id",
            f"slot_id {slot.slot_id!r} must be 1-256 characters of letters, "
            "digits and _-.:/ (the usual form is cluster:node:gpu)",
        )
    if slot.state not in REGISTRABLE_STATES:
        return (
            "state",
            f"a slot is registered as 'idle' (operators) or 'hot' (a job's "
            f"spare), not {slot.state.value!r}; use quarantine for the others",
        )
    if slot.state is SpareState.HOT and not slot.job_id:
        return ("job_id", "a hot spare belongs to a job: job_id is required with state 'hot'")
    if slot.state is SpareState.IDLE and (slot.job_id or slot.member_id):
        field = "job_id" if slot.job_id else "member_id"
        return (field, f"an idle slot belongs to no job: omit {field} or register it as 'hot'")
    return None


def register_conflict(existing: SpareSlot, new: SpareSlot) -> str | None:
    """Why ``new`` may not overwrite the registered ``existing`` slot; None when it may.

    Re-registering is idempotent; a hot spare changes hands only after its job lets it go,
    and a slot that is leased or in use is not touched until it is released.
    """
    if (existing.cluster, existing.node, existing.gpu) != (new.cluster, new.node, new.gpu):
        return (
            f"slot {existing.slot_id} is registered for {existing.cluster}/{existing.node}"
            f" gpu {existing.gpu}, not {new.cluster}/{new.node} gpu {new.gpu}"
        )
    same_owner = new.state is SpareState.HOT and new.job_id == existing.job_id
    if existing.state in (SpareState.RESERVED, SpareState.IN_USE):
        if same_owner and new.member_id == existing.member_id:
            return None
        return (
            f"slot {existing.slot_id} is {existing.state.value} by job {existing.job_id}; "
            "release its lease before registering it again"
        )
    if existing.state is SpareState.HOT and not same_owner:
        return (
            f"slot {existing.slot_id} is a hot spare of job {existing.job_id}; it leaves "
            "the pool when that job finishes or its spare stops heartbeating"
        )
    return None


def readmission_problem(
    beat: Heartbeat, kept: SpareSlot | None, generation: Generation | None
) -> str | None:
    """Why a hot spare removed for lack of beats may not come back on ``beat``; None: it may.

    ``kept`` is the registration the sweep kept for it (None once its job ended or after
    ``LAPSED_KEEP_S``); ``generation`` the job's current one, if any. It comes back only as
    what it was: a spare of the same job that holds no rank, by its own beat and by the
    job's generation (a spare named while it was starved is taking its rank, not waiting).
    """
    if kept is None:
        return "no registration is kept for it (its job ended, or it lapsed long ago)"
    if beat.job_id != kept.job_id:
        return f"it beats for job {beat.job_id} but was a spare of job {kept.job_id}"
    if beat.rank is not None or beat.generation != 0:
        return f"it holds rank {beat.rank} in generation {beat.generation}"
    if generation is not None:
        rank = generation.member_rank(beat.member_id)
        if rank is not None:
            return (
                f"generation {generation.generation} of job {beat.job_id} names it for rank {rank}"
            )
    return None


# --------------------------------------------------------------------------- locality


@dataclass(frozen=True)
class Topology:
    """Where a node sits: what the locality order compares."""

    nvlink_domain: str
    rack: str
    zone: str


@dataclass(frozen=True)
class Candidate:
    """A slot as the reservation sees it: the slot and whether its node may be used."""

    slot: SpareSlot
    excluded: bool = False  # quarantined by the pool, or unhealthy/lemon per the detector


def misfit(slot: SpareSlot, gpu_model: str | None, min_memory_mb: int) -> str | None:
    """Why ``slot`` cannot serve a request: ``"gpu_model"``, ``"min_memory_mb"`` or None."""
    if gpu_model is not None and slot.gpu_model != gpu_model:
        return "gpu_model"
    if slot.memory_mb < min_memory_mb:
        return "min_memory_mb"
    return None


def locality_tier(slot: SpareSlot, request: ReserveRequest, near: Topology | None) -> int | None:
    """The index in :data:`TIERS` of ``slot`` for ``request``; None if it is not a candidate.

    A hot spare is a candidate only for its own job; an idle slot for any job of its cluster.
    """
    if slot.cluster != request.cluster:
        return None
    if slot.state is SpareState.HOT:
        return 0 if slot.job_id == request.job_id else None
    if slot.state is not SpareState.IDLE:
        return None
    if near is None:
        return TIERS.index("any")
    if slot.nvlink_domain == near.nvlink_domain:
        return TIERS.index("nvlink_domain")
    if slot.rack == near.rack:
        return TIERS.index("rack")
    if slot.zone == near.zone:
        return TIERS.index("zone")
    return TIERS.index("any")


def pick_spare(
    candidates: Iterable[Candidate], request: ReserveRequest, near: Topology | None
) -> tuple[SpareSlot, str] | None:
    """The slot a reservation should get, with its tier name; None if nothing fits.

    Order: tier (hot for this job, same NVLink domain as ``near_node``, same rack, same
    zone, any); within a tier a slot off ``near_node`` (the node that just failed) before one
    on it; then ``slot_id``. Excluded nodes and slots that do not fit are never picked.
    """
    best: tuple[int, bool, str] | None = None
    chosen: SpareSlot | None = None
    for cand in candidates:
        slot = cand.slot
        tier = locality_tier(slot, request, near)
        if tier is None or cand.excluded:
            continue
        if misfit(slot, request.gpu_model, request.min_memory_mb) is not None:
            continue
        key = (tier, slot.node == request.near_node, slot.slot_id)
        if best is None or key < best:
            best, chosen = key, slot
    if chosen is None or best is None:
        return None
    return chosen, TIERS[best[0]]


# --------------------------------------------------------------------------- floors

Floors = Mapping[str, int]


def parse_floors(text: str) -> dict[str, int]:
    """Parse ``TORCHRELAY_SPARE_FLOOR``: a default and/or per-domain floors.

    Forms: ``""`` or ``"0"`` (no floor), ``"2"`` (every domain), or comma-separated
    ``domain=N`` / ``cluster/domain=N`` / ``*=N`` entries, e.g. ``"*=1,local/nvl-0=4"``.

    Raises:
        ValueError: an entry is malformed; the message names it.
    """
    floors: dict[str, int] = {}
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        key, sep, value = entry.rpartition("=")
        if not sep:
            key, value = "*", entry
        key = key.strip()
        try:
            number = int(value.strip())
        except ValueError:
            raise ValueError(
                f"TORCHRELAY_SPARE_FLOOR entry {entry!r}: the floor must be an "
                "integer, as in '*=1,local/nvl-0=4'"
            ) from None
        if number < 0 or not key:
            raise ValueError(
                f"TORCHRELAY_SPARE_FLOOR entry {entry!r}: expected [cluster/]domain=N with N >= 0"
            )
        floors[key] = number
    return floors


def floor_for(floors: Floors, cluster: str, nvlink_domain: str) -> int:
    """The floor of one domain: ``cluster/domain``, else ``domain``, else ``*``, else 0."""
    for key in (f"{cluster}/{nvlink_domain}", nvlink_domain, "*"):
        if key in floors:
            return floors[key]
    return 0


def pool_low_change(
    available: int, floor: int, was_low: bool
) -> Literal["low", "recovered"] | None:
    """Whether a domain just fell below its floor (``low``) or came back (``recovered``).

    A floor of 0 disables the alarm; one event per episode, not one per reservation.
    """
    is_low = floor > 0 and available < floor
    if is_low and not was_low:
        return "low"
    if was_low and not is_low:
        return "recovered"
    return None


__all__ = [
    "DEFAULT_LEASE_S",
    "EXCLUDING_HEALTH",
    "TIERS",
    "Candidate",
    "DepthRequest",
    "GetRequest",
    "LeaseRequest",
    "ListRequest",
    "QuarantineRequest",
    "ReleaseRequest",
    "ReserveRequest",
    "ReturnRequest",
    "Topology",
    "default_slot_id",
    "floor_for",
    "locality_tier",
    "misfit",
    "parse_floors",
    "pick_spare",
    "pool_low_change",
    "register_conflict",
    "registration_problem",
]
