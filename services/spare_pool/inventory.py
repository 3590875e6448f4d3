"""The spare inventory in Redis: slots, leases, exclusions, and every transition's history.

Every change of a slot's state runs inside one Lua script (``lua/*.lua``, package data), so
a reservation is atomic and a slot can never be leased twice, however many executors and
pool replicas race. Keys live under the service's prefix (``tr:spare_pool``):

- ``:slot:<id>`` hash: the :class:`~torchrelay.contract.SpareSlot` fields, plus ``home``
  (the state it returns to: ``idle`` or ``hot``), ``lease_id``, ``lease_expires_ms``,
  ``prev_state``, ``reason``, ``updated_ms``, ``version``;
- ``:hist:<id>`` list: one JSON entry per transition (time, from, to, reason);
- ``:slots`` (all ids, lexicographic), ``:idle|<cluster>[|d|<domain>|r|<rack>|z|<zone>]``
  (idle slots, by locality), ``:hot|<job>``, ``:job|<job>``, ``:nodeslots|<cluster>|<node>``;
- ``:lease:<id>`` hash and ``:leases`` (active leases by expiry);
- ``:excl|<node>`` (the pool's quarantine of a node or GPU, remembered for later
  registrations), ``:health|<cluster>|<node>`` (the detector's unhealthy/lemon verdicts);
- ``:member|<member_id>`` and ``:hb`` (hot spares' heartbeat deadlines).

Time is Redis's own clock (``TIME``) unless a clock is injected (tests), so pool replicas on
different hosts agree on when a lease expires.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from torchrelay.bus import Conflict, NotFound
from torchrelay.contract import SpareSlot, SpareState, make_event_id

from .rules import (
    EXCLUDING_HEALTH,
    ReserveRequest,
    register_conflict,
)

HISTORY_MAX = 200
LEASE_TTL_MS = 24 * 3600 * 1000  # ended leases are remembered a day (idempotent replies)
HISTORY_TTL_MS = 7 * 24 * 3600 * 1000  # history of a slot that left the pool
LAPSED_KEEP_S = 7 * 24 * 3600  # a lapsed hot spare's registration, kept to re-admit it
SWEEP_LIMIT = 256

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- Lua


def _lua(name: str) -> str:
    """A script of ``lua/`` (package data): the one source of the pool's atomic rules."""
    return resources.files(__package__).joinpath("lua", name).read_text()


# Shared by every script. KEYS[1] is the prefix, ARGV[1] the time in ms (negative: ask
# Redis). Scripts build their keys from the prefix: this runs on one Redis primary, not a
# Redis Cluster (where keys would have to be declared and share a hash slot).
_LIB = _lua("lib.lua")
_REGISTER = _lua("register.lua")
_RESERVE = _lua("reserve.lua")
_CONFIRM = _lua("confirm.lua")
_RELEASE = _lua("release.lua")
_QUARANTINE = _lua("quarantine.lua")
_RETURN = _lua("return.lua")
_HEARTBEAT = _lua("heartbeat.lua")
_SWEEP = _lua("sweep.lua")
_JOB_FINISHED = _lua("job_finished.lua")
_DEPTH = _lua("depth.lua")


# --------------------------------------------------------------------------- results


def _ms_to_dt(value: Any) -> datetime | None:
    if value in (None, "", b""):
        return None
    return datetime.fromtimestamp(int(float(value)) / 1000.0, UTC)


def _as_list(value: Any) -> list[Any]:
    # cjson encodes an empty Lua table as {}.
    return value if isinstance(value, list) else []


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _lapsed_view(raw: Any) -> SlotView | None:
    """A kept registration (the slot hash as JSON), or None when it cannot be read."""
    try:
        decoded = json.loads(raw)
        return SlotView.from_hash(decoded) if isinstance(decoded, dict) else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclass(frozen=True)
class SlotView:
    """A slot as stored: the contract's SpareSlot plus the pool's bookkeeping."""

    slot: SpareSlot
    home: str = "idle"
    lease_id: str | None = None
    lease_expires_at: datetime | None = None
    reason: str = ""
    updated_at: datetime | None = None

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> SlotView:
        """Build from a slot hash (bytes from redis-py, or str from a script's JSON)."""
        h = {_str(k): _str(v) for k, v in raw.items()}
        slot = SpareSlot(
            slot_id=h["slot_id"],
            cluster=h["cluster"],
            node=h["node"],
            gpu=int(h["gpu"]),
            gpu_model=h.get("gpu_model", ""),
            memory_mb=int(h.get("memory_mb") or 0),
            nvlink_domain=h.get("nvlink_domain", "default"),
            rack=h.get("rack", "default"),
            zone=h.get("zone", "default"),
            state=SpareState(h["state"]),
            job_id=h.get("job_id") or None,
            member_id=h.get("member_id") or None,
        )
        return cls(
            slot=slot,
            home=h.get("home") or "idle",
            lease_id=h.get("lease_id") or None,
            lease_expires_at=_ms_to_dt(h.get("lease_expires_ms")),
            reason=h.get("reason", ""),
            updated_at=_ms_to_dt(h.get("updated_ms")),
        )

    def to_json(self) -> dict[str, Any]:
        """The slot's fields (as SpareSlot) and the bookkeeping, for replies."""
        out = self.slot.model_dump(mode="json")
        out.update(
            home=self.home,
            lease_id=self.lease_id,
            lease_expires_at=self.lease_expires_at.isoformat() if self.lease_expires_at else None,
            reason=self.reason,
            updated_at=self.updated_at.isoformat() if self.updated_at else None,
        )
        return out


@dataclass(frozen=True)
class LeaseEnd:
    """A lease that ended (released, expired or revoked): one SpareReleased event."""

    lease_id: str
    slot_id: str
    job_id: str
    reason: str
    outcome: str

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LeaseEnd:
        return cls(
            lease_id=raw["lease_id"],
            slot_id=raw["slot_id"],
            job_id=raw["job_id"],
            reason=raw["reason"],
            outcome=raw["outcome"],
        )


@dataclass(frozen=True)
class Lease:
    """A granted reservation: the slot is held until ``expires_at`` unless confirmed."""

    lease_id: str
    slot: SlotView
    expires_at: datetime
    tier: str
    job_id: str
    replayed: bool = False
    near_known: bool = False

    def to_json(self) -> dict[str, Any]:
        """The ``reserve`` reply."""
        return {
            "lease_id": self.lease_id,
            "slot": self.slot.to_json(),
            "expires_at": self.expires_at.isoformat(),
            "tier": self.tier,
            "job_id": self.job_id,
            "replayed": self.replayed,
            "near_node_known": self.near_known,
        }


@dataclass(frozen=True)
class ReserveOutcome:
    """What a reservation did: the lease (or why none fits) and leases it found expired."""

    lease: Lease | None
    expired: list[LeaseEnd]
    error: NotFound | Conflict | None = None


@dataclass(frozen=True)
class QuarantineOutcome:
    """The slots of a quarantined node or GPU, and what changed."""

    known: bool
    slots: list[SlotView]
    changed: list[str]
    revoked: list[LeaseEnd]
    since_ms: int


@dataclass(frozen=True)
class SweepOutcome:
    """Leases the sweep expired and hot spares it removed for lack of heartbeats."""

    expired: list[LeaseEnd]
    removed: list[dict[str, str]]


@dataclass(frozen=True)
class JobFinishedOutcome:
    """What a job's end did to its spares."""

    ended: list[LeaseEnd]
    removed: list[str]
    freed: list[str]


@dataclass(frozen=True)
class DomainDepth:
    """Idle spares on healthy nodes of one NVLink domain."""

    cluster: str
    nvlink_domain: str
    available: int


@dataclass
class _Scripts:
    register: AsyncScript
    reserve: AsyncScript
    confirm: AsyncScript
    release: AsyncScript
    quarantine: AsyncScript
    return_: AsyncScript
    heartbeat: AsyncScript
    sweep: AsyncScript
    job_finished: AsyncScript
    depth: AsyncScript
    extra: dict[str, AsyncScript] = field(default_factory=dict)


def no_fit_message(
    request: ReserveRequest, counts: dict[str, Any], models: Sequence[str]
) -> tuple[str, str | None]:
    """Why no spare fits a reservation, and the request field to blame (if one is)."""
    considered = int(counts.get("considered", 0))
    head = f"no spare fits job {request.job_id} in cluster {request.cluster}"
    if considered == 0:
        return (
            f"{head}: it has no idle spare (nor a hot spare of this job); register "
            "spares or wait for one to be released",
            "cluster",
        )
    parts = []
    wrong_model = int(counts.get("gpu_model", 0))
    small = int(counts.get("min_memory_mb", 0))
    excluded = int(counts.get("excluded", 0))
    if wrong_model:
        have = ", ".join(models) or "?"
        parts.append(
            f"{wrong_model} of another gpu_model than {request.gpu_model!r} (have: {have})"
        )
    if small:
        parts.append(f"{small} with less than min_memory_mb={request.min_memory_mb}")
    if excluded:
        parts.append(f"{excluded} on quarantined, unhealthy or lemon nodes")
    blame = None
    if wrong_model == considered:
        blame = "gpu_model"
    elif small == considered:
        blame = "min_memory_mb"
    return f"{head}: of {considered} candidate slots, " + "; ".join(parts), blame


class SpareInventory:
    """The spare pool's state in Redis; every transition is one atomic script.

    Args:
        redis: an asyncio Redis client.
        prefix: the key prefix (the service's ``ctx.prefix``).
        clock: seconds since the epoch; None uses Redis's clock (production).
        heartbeat_grace_s: how long a newly registered hot spare may go without a heartbeat.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str,
        *,
        clock: Callable[[], float] | None = None,
        heartbeat_grace_s: float = 60.0,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self._clock = clock
        lib = (
            _LIB.replace("@HISTORY_MAX@", str(HISTORY_MAX))
            .replace("@LEASE_TTL_MS@", str(LEASE_TTL_MS))
            .replace("@HISTORY_TTL_MS@", str(HISTORY_TTL_MS))
            .replace("@HB_GRACE_MS@", str(int(heartbeat_grace_s * 1000)))
        )

        def script(body: str) -> AsyncScript:
            return redis.register_script(lib + body)

        self._s = _Scripts(
            register=script(_REGISTER),
            reserve=script(_RESERVE),
            confirm=script(_CONFIRM),
            release=script(_RELEASE),
            quarantine=script(_QUARANTINE),
            return_=script(_RETURN),
            heartbeat=script(_HEARTBEAT),
            sweep=script(_SWEEP),
            job_finished=script(_JOB_FINISHED),
            depth=script(_DEPTH),
        )

    # ----------------------------------------------------------------- plumbing

    def _now_arg(self) -> str:
        return "-1" if self._clock is None else str(int(self._clock() * 1000))

    async def _run(self, script: AsyncScript, *args: str | int) -> Any:
        raw = await script(keys=[self.prefix], args=[self._now_arg(), *args])
        return json.loads(raw)

    @staticmethod
    def _raise(reply: dict[str, Any]) -> None:
        if reply.get("error") == "not_found":
            raise NotFound(reply["message"], reply.get("field"))
        if reply.get("error") == "conflict":
            raise Conflict(reply["message"], reply.get("field"))

    def key(self, *parts: str) -> str:
        """A key under this inventory's prefix."""
        return self.prefix + ":" + ":".join(parts)

    # ----------------------------------------------------------------- verbs

    async def get_slot(self, slot_id: str) -> SlotView | None:
        """The slot, or None if it is not (or no longer) in the pool."""
        raw = await self.redis.hgetall(self.key("slot", slot_id))
        return SlotView.from_hash(raw) if raw else None

    async def history(self, slot_id: str) -> list[dict[str, Any]]:
        """Every transition of a slot, oldest first (the last 200)."""
        raw = await self.redis.lrange(self.key("hist", slot_id), 0, -1)
        return [json.loads(item) for item in raw]

    async def register(self, slot: SpareSlot) -> tuple[SlotView, str]:
        """Add or update a slot; returns the stored slot and the state it came from.

        Raises:
            Conflict: the slot is a hot spare of another job, or leased, or in use.
        """
        payload = slot.model_dump(mode="json")
        payload["job_id"] = slot.job_id or ""
        payload["member_id"] = slot.member_id or ""
        # Optimistic: the rule runs here, the write only if nobody changed the slot since.
        for _ in range(20):
            raw = await self.redis.hgetall(self.key("slot", slot.slot_id))
            version = ""
            if raw:
                existing = SlotView.from_hash(raw)
                problem = register_conflict(existing.slot, slot)
                if problem:
                    raise Conflict(problem, "slot_id")
                version = _str(raw[b"version"])
            reply = await self._run(self._s.register, json.dumps(payload), version)
            if not reply.get("retry"):
                return SlotView.from_hash(reply["slot"]), str(reply["from"])
        raise Conflict(
            f"slot {slot.slot_id} kept changing while it was registered; retry", "slot_id"
        )

    async def reserve(self, request: ReserveRequest) -> ReserveOutcome:
        """Lease the best fitting spare (one atomic script); see ``rules.pick_spare``."""
        if request.request_id:
            lease_id = make_event_id("lease", request.job_id, request.request_id)
        else:
            lease_id = uuid.uuid4().hex
        reply = await self._run(
            self._s.reserve,
            request.job_id,
            request.cluster,
            request.near_node or "",
            request.gpu_model or "",
            request.min_memory_mb,
            int(request.lease_s * 1000),
            lease_id,
            SWEEP_LIMIT,
        )
        expired = [LeaseEnd.from_json(e) for e in _as_list(reply.get("expired"))]
        if reply.get("error") == "conflict":
            return ReserveOutcome(None, expired, Conflict(reply["message"], reply.get("field")))
        if reply.get("error") == "not_found":
            message, blame = no_fit_message(request, reply["counts"], _as_list(reply.get("models")))
            return ReserveOutcome(None, expired, NotFound(message, blame))
        expires = _ms_to_dt(reply["expires_ms"])
        assert expires is not None
        lease = Lease(
            lease_id=reply["lease_id"],
            slot=SlotView.from_hash(reply["slot"]),
            expires_at=expires,
            tier=reply["tier"],
            job_id=request.job_id,
            replayed=bool(reply.get("replayed")),
            near_known=bool(reply.get("near_known")),
        )
        return ReserveOutcome(lease, expired)

    async def confirm(
        self, lease_id: str
    ) -> tuple[SlotView | None, list[LeaseEnd], Exception | None]:
        """Turn a lease into a slot in use; an expired lease is refused (and ended)."""
        reply = await self._run(self._s.confirm, lease_id)
        expired = [LeaseEnd.from_json(e) for e in _as_list(reply.get("expired"))]
        if reply.get("error"):
            try:
                self._raise(reply)
            except (NotFound, Conflict) as exc:
                return None, expired, exc
        return SlotView.from_hash(reply["slot"]), expired, None

    async def release(
        self, lease_id: str, reason: str
    ) -> tuple[SlotView | None, LeaseEnd | None, str]:
        """Give a lease's slot back to its previous state; idempotent.

        Returns the slot (None if it left the pool), the ended lease (None if it had already
        ended) and the lease's outcome.

        Raises:
            NotFound: no such lease.
        """
        reply = await self._run(self._s.release, lease_id, reason)
        self._raise(reply)
        slot = reply.get("slot")
        ended = reply.get("ended")
        return (
            SlotView.from_hash(slot) if isinstance(slot, dict) and slot else None,
            LeaseEnd.from_json(ended) if isinstance(ended, dict) and ended else None,
            str(reply.get("outcome")),
        )

    async def list_slots(
        self,
        *,
        cluster: str | None = None,
        state: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> tuple[list[SlotView], str | None]:
        """One page of slots in slot_id order, filtered; the cursor is the last id returned."""
        items: list[SlotView] = []
        start = f"({cursor}" if cursor else "-"
        batch = max(limit, 200)
        while len(items) < limit:
            ids = await self.redis.zrangebylex(self.key("slots"), start, "+", 0, batch)
            if not ids:
                return items, None
            pipe = self.redis.pipeline(transaction=False)
            for slot_id in ids:
                pipe.hgetall(self.key("slot", _str(slot_id)))
            for slot_id, raw in zip(ids, await pipe.execute(), strict=True):
                start = f"({_str(slot_id)}"
                if not raw:
                    continue
                view = SlotView.from_hash(raw)
                if cluster and view.slot.cluster != cluster:
                    continue
                if state and view.slot.state.value != state:
                    continue
                items.append(view)
                if len(items) == limit:
                    more = await self.redis.zrangebylex(self.key("slots"), start, "+", 0, 1)
                    return items, (view.slot.slot_id if more else None)
            if len(ids) < batch:
                return items, None
        return items, None

    async def quarantine(
        self, node: str, *, gpu: int | None, cluster: str | None, reason: str, rma: bool
    ) -> QuarantineOutcome:
        """Move a node's (or one GPU's) slots to quarantined/rma and exclude it from now on.

        Leases on those slots are revoked. The exclusion is recorded even for a node the
        pool has never seen (``known`` is False then), so slots registered on it later start
        quarantined.
        """
        state = SpareState.RMA.value if rma else SpareState.QUARANTINED.value
        reply = await self._run(
            self._s.quarantine, cluster or "", node, "" if gpu is None else str(gpu), state, reason
        )
        return QuarantineOutcome(
            known=bool(reply["known"]),
            slots=[SlotView.from_hash(s) for s in _as_list(reply.get("slots"))],
            changed=[str(c) for c in _as_list(reply.get("changed"))],
            revoked=[LeaseEnd.from_json(e) for e in _as_list(reply.get("revoked"))],
            since_ms=int(reply["since"]),
        )

    async def return_to_service(
        self, node: str, *, gpu: int | None, cluster: str | None, reason: str
    ) -> list[SlotView]:
        """Quarantined/RMA slots of a node (or GPU) back to idle; the exclusion is lifted.

        Raises:
            NotFound: the pool knows no slot and no quarantine of that node.
            Conflict: one GPU was named but the whole node is quarantined.
        """
        reply = await self._run(
            self._s.return_, cluster or "", node, "" if gpu is None else str(gpu), reason
        )
        self._raise(reply)
        return [SlotView.from_hash(s) for s in _as_list(reply.get("returned"))]

    async def set_health(self, cluster: str, node: str, gpu: int | None, health: str) -> None:
        """Record the detector's verdict on a node (or GPU): excluded unless healthy/degraded."""
        key = self.key(f"health|{cluster}|{node}")
        field_ = "*" if gpu is None else str(gpu)
        if health in EXCLUDING_HEALTH:
            await self.redis.hset(key, field_, health)
        else:
            await self.redis.hdel(key, field_)

    async def exclusion_of(self, slot: SpareSlot) -> dict[str, str]:
        """Why a slot's node is kept out of reservations: ``{"quarantine": ..., "health": ...}``."""
        excl = await self.redis.hmget(
            self.key(f"excl|{slot.node}"),
            f"{slot.cluster}|{slot.gpu}",
            f"{slot.cluster}|*",
            f"*|{slot.gpu}",
            "*|*",
        )
        health = await self.redis.hmget(
            self.key(f"health|{slot.cluster}|{slot.node}"), str(slot.gpu), "*"
        )
        out: dict[str, str] = {}
        for raw in excl:
            if raw:
                out["quarantine"] = json.loads(raw)["reason"]
                break
        for raw in health:
            if raw:
                out["health"] = _str(raw)
                break
        return out

    async def heartbeat(self, member_id: str, timeout_s: float) -> bool:
        """A hot spare's heartbeat: push its deadline out. False if it is not tracked."""
        return bool(await self._run(self._s.heartbeat, member_id, int(timeout_s * 1000)))

    async def tracked_members(self) -> set[str]:
        """Members of hot spares whose heartbeats the pool watches."""
        return {_str(m) for m in await self.redis.zrange(self.key("hb"), 0, -1)}

    async def sweep(self) -> SweepOutcome:
        """Expire due leases and drop hot spares whose heartbeats stopped."""
        reply = await self._run(self._s.sweep, SWEEP_LIMIT, LAPSED_KEEP_S * 1000)
        return SweepOutcome(
            expired=[LeaseEnd.from_json(e) for e in _as_list(reply.get("expired"))],
            removed=[dict(r) for r in _as_list(reply.get("removed"))],
        )

    # A hot spare whose beats lapsed (its process starved for seconds under load, the
    # network cut) is removed by the sweep, but its process may well live on. The sweep
    # keeps the removed slot's registration (``lapsed_reg``, member -> the slot's fields, for
    # ``LAPSED_KEEP_S``) so that its next beat can bring it back instead of leaving the job
    # without its spare (``SparePool.on_heartbeat``).

    async def lapsed_members(self) -> set[str]:
        """The hot spares the sweep removed for lack of beats, still re-admissible."""
        return {_str(m) for m in await self.redis.hkeys(self.key("lapsed_reg"))}

    async def lapsed(self, member_id: str) -> SpareSlot | None:
        """A lapsed spare's kept registration (None: none is kept).

        The slot as it was registered: a hot spare of its job, whatever lease it held then
        (the sweep revoked it). A kept entry that cannot be read (edited or corrupted in
        Redis) is dropped, with a warning naming it: it could never be re-admitted.
        """
        raw = await self.redis.hget(self.key("lapsed_reg"), member_id)
        if raw is None:
            return None
        view = _lapsed_view(raw)
        if view is None:
            log.warning(
                "dropping the unreadable kept registration of lapsed spare %s: %r",
                member_id,
                raw[:200],
            )
            await self.forget_lapsed_member(member_id)
            return None
        return view.slot.model_copy(update={"state": SpareState.HOT})

    async def forget_lapsed_member(self, member_id: str) -> None:
        """A lapsed spare came back, or may no longer: its registration is not kept."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hdel(self.key("lapsed_reg"), member_id)
        pipe.zrem(self.key("lapsed_at"), member_id)
        await pipe.execute()

    async def forget_lapsed(self, job_id: str) -> list[str]:
        """The job ended: its lapsed spares are not to come back. Returns their members.

        Unreadable kept entries (see :meth:`lapsed`) are dropped too, not returned.
        """
        entries = await self.redis.hgetall(self.key("lapsed_reg"))
        gone: list[str] = []
        unreadable: list[str] = []
        for member, raw in entries.items():
            view = _lapsed_view(raw)
            if view is None:
                unreadable.append(_str(member))
            elif view.slot.job_id == job_id:
                gone.append(_str(member))
        if unreadable:
            log.warning("dropping unreadable kept registrations of lapsed spares %s", unreadable)
        if gone or unreadable:
            pipe = self.redis.pipeline(transaction=True)
            pipe.hdel(self.key("lapsed_reg"), *gone, *unreadable)
            pipe.zrem(self.key("lapsed_at"), *gone, *unreadable)
            await pipe.execute()
        return gone

    async def job_finished(self, job_id: str, reason: str) -> JobFinishedOutcome:
        """The job's hot spares leave the pool; idle slots it held go back to idle."""
        reply = await self._run(self._s.job_finished, job_id, reason)
        return JobFinishedOutcome(
            ended=[LeaseEnd.from_json(e) for e in _as_list(reply.get("ended"))],
            removed=[str(r) for r in _as_list(reply.get("removed"))],
            freed=[str(r) for r in _as_list(reply.get("freed"))],
        )

    async def depth(
        self, cluster: str | None = None, nvlink_domain: str | None = None
    ) -> list[DomainDepth]:
        """Idle spares on healthy, unquarantined nodes per (cluster, NVLink domain)."""
        reply = await self._run(self._s.depth, cluster or "", nvlink_domain or "")
        return [DomainDepth(str(c), str(d), int(n)) for c, d, n in _as_list(reply)]

    async def was_low(self, cluster: str, nvlink_domain: str) -> int | None:
        """When the domain's current low episode began (ms), or None if it is not low."""
        raw = await self.redis.hget(self.key("low"), f"{cluster}|{nvlink_domain}")
        return int(raw) if raw else None

    async def mark_low(self, cluster: str, nvlink_domain: str, since_ms: int) -> int:
        """Start a low episode unless one is open; returns the episode's start (ms)."""
        field_ = f"{cluster}|{nvlink_domain}"
        await self.redis.hsetnx(self.key("low"), field_, since_ms)
        raw = await self.redis.hget(self.key("low"), field_)
        return int(raw) if raw else since_ms

    async def clear_low(self, cluster: str, nvlink_domain: str) -> None:
        """The domain is back at or above its floor."""
        await self.redis.hdel(self.key("low"), f"{cluster}|{nvlink_domain}")

    async def audit(self) -> list[str]:
        """Consistency problems of the stored inventory (tests, and operators' debugging).

        Each slot must be in exactly one state, sit in exactly the indexes that state
        implies, and a leased slot must be held by exactly one active lease.
        """
        problems: list[str] = []
        ids = [_str(i) for i in await self.redis.zrange(self.key("slots"), 0, -1)]
        leased_by: dict[str, str] = {}
        for lid in await self.redis.zrange(self.key("leases"), 0, -1):
            lease = {
                _str(k): _str(v)
                for k, v in (await self.redis.hgetall(self.key("lease", _str(lid)))).items()
            }
            if lease.get("state") != "active":
                problems.append(
                    f"lease {_str(lid)} is indexed as active but is {lease.get('state')}"
                )
                continue
            if lease["slot_id"] in leased_by:
                problems.append(f"slot {lease['slot_id']} is held by two leases")
            leased_by[lease["slot_id"]] = _str(lid)
        states = {s.value for s in SpareState}
        for slot_id in ids:
            raw = await self.redis.hgetall(self.key("slot", slot_id))
            if not raw:
                problems.append(f"slot {slot_id} is indexed but has no record")
                continue
            view = SlotView.from_hash(raw)
            s = view.slot
            if s.state.value not in states:
                problems.append(f"slot {slot_id} has unknown state {s.state}")
            base = f"idle|{s.cluster}"
            idle_keys = [
                base,
                f"{base}|d|{s.nvlink_domain}",
                f"{base}|r|{s.rack}",
                f"{base}|z|{s.zone}",
            ]
            for k in idle_keys:
                member = await self.redis.zscore(self.key(k), slot_id) is not None
                if member != (s.state is SpareState.IDLE):
                    problems.append(
                        f"slot {slot_id} ({s.state.value}) "
                        f"{'is' if member else 'is not'} in index {k}"
                    )
            if s.job_id:
                hot = await self.redis.zscore(self.key(f"hot|{s.job_id}"), slot_id) is not None
                if hot != (s.state is SpareState.HOT):
                    problems.append(f"slot {slot_id} ({s.state.value}) hot-index mismatch")
            if (s.state is SpareState.RESERVED) != (slot_id in leased_by):
                problems.append(
                    f"slot {slot_id} is {s.state.value} but "
                    f"{'has' if slot_id in leased_by else 'has no'} active lease"
                )
            if slot_id in leased_by and view.lease_id != leased_by[slot_id]:
                problems.append(
                    f"slot {slot_id} names lease {view.lease_id}, held by {leased_by[slot_id]}"
                )
        return problems


__all__ = [
    "DomainDepth",
    "JobFinishedOutcome",
    "Lease",
    "LeaseEnd",
    "QuarantineOutcome",
    "ReserveOutcome",
    "SlotView",
    "SpareInventory",
    "SweepOutcome",
    "no_fit_message",
]
