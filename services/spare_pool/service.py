"""The spare-pool service: its RPC verbs, the events it consumes, the sweeper and metrics.

Handlers validate the request, call one :class:`~.inventory.SpareInventory` operation (one
Lua script), then publish what changed: ``SpareReserved``, ``SpareReleased``,
``SpareQuarantined`` and ``SparePoolLow``, each with a deterministic event id so a retried
request or a redelivered event publishes nothing twice.

Verbs on ``tr.rpc.spare_pool.<verb>`` (errors: ``invalid`` / ``not_found`` / ``conflict``,
naming the field):

- ``register`` SpareSlot fields (``slot_id`` defaults to ``cluster:node:gpu``; state ``idle``
  or ``hot`` with ``job_id``/``member_id``) -> ``{slot, previous_state}``; a slot on a
  quarantined node is stored as ``quarantined``.
- ``reserve {job_id, cluster, near_node?, gpu_model?, min_memory_mb?, lease_s=30,
  request_id?}`` -> ``{lease_id, slot, expires_at, tier, replayed, near_node_known}``; the
  same ``request_id`` gets the same lease back; nothing fits -> ``not_found`` saying why.
- ``confirm {lease_id}`` -> ``{lease_id, slot}`` (in_use); expired/revoked -> ``conflict``.
- ``release {lease_id, reason}`` -> ``{lease_id, outcome, slot}``; idempotent.
- ``list {cluster?, state?, limit=100, cursor?}`` -> ``{items, next_cursor}``.
- ``get {slot_id}`` -> the slot, ``excluded_by`` and its ``history`` of transitions.
- ``quarantine {node, gpu?, cluster?, reason, rma=false}`` -> the node's slots; their leases
  are revoked and the node stays excluded for later registrations. A node the pool has never
  seen answers ``not_found`` (its exclusion is still remembered).
- ``return {node, gpu?, cluster?, reason?}`` -> ``{returned, still_unhealthy}``.
- ``depth {cluster?}`` -> ``[{cluster, nvlink_domain, available, floor, low}]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Iterable
from typing import Any

from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge
from pydantic import Field, ValidationError

from torchrelay.bus import Conflict, Delivery, NotFound, RequestInvalid
from torchrelay.contract import (
    Event,
    Heartbeat,
    JobFinished,
    NodeHealthChanged,
    SparePoolLow,
    SpareQuarantined,
    SpareReleased,
    SpareReserved,
    SpareSlot,
    Subjects,
    make_event_id,
)
from torchrelay.service import ServiceContext
from torchrelay.settings import ServiceSettings, SettingsError

from .inventory import Lease, LeaseEnd, SlotView, SpareInventory
from .rules import (
    DepthRequest,
    GetRequest,
    LeaseRequest,
    ListRequest,
    QuarantineRequest,
    ReleaseRequest,
    ReserveRequest,
    ReturnRequest,
    default_slot_id,
    floor_for,
    parse_floors,
    pool_low_change,
    readmission_problem,
    registration_problem,
)

SERVICE = "spare_pool"
HEARTBEAT_QUEUE = "spare_pool"


class SparePoolSettings(ServiceSettings):
    """Settings of the spare pool (``TORCHRELAY_SPARE_*``)."""

    spare_floor: str = ""  # TORCHRELAY_SPARE_FLOOR: "2", or "*=1,local/nvl-0=4"
    spare_sweep_interval_s: float = Field(default=0.5, gt=0)
    spare_heartbeat_timeout_s: float = Field(default=10.0, gt=0)
    # A hot spare is registered before its process has imported torch and started beating.
    spare_heartbeat_grace_s: float = Field(default=60.0, gt=0)
    spare_depth_refresh_s: float = Field(default=5.0, gt=0)


def pool_settings(settings: ServiceSettings) -> SparePoolSettings:
    """The pool's settings, from ``settings`` when it already is one, else the environment."""
    if isinstance(settings, SparePoolSettings):
        return settings
    try:
        return SparePoolSettings(**settings.model_dump())
    except ValidationError as exc:
        raise SettingsError(f"invalid TORCHRELAY_SPARE_* settings: {exc}") from exc


class SparePool:
    """One spare-pool process: the inventory plus the bus, metrics and the sweeper."""

    def __init__(
        self, ctx: ServiceContext, settings: SparePoolSettings, inventory: SpareInventory
    ) -> None:
        self.ctx = ctx
        self.settings = settings
        self.inventory = inventory
        self.log = ctx.log if ctx.log else logging.getLogger("torchrelay.spare_pool")
        try:
            self.floors = parse_floors(settings.spare_floor)
        except ValueError as exc:
            raise SettingsError(str(exc)) from exc
        # Hot spares whose beats matter; refreshed by every sweep. Every job's heartbeats
        # arrive here, and most are not from spares: they are dropped without a Redis call.
        self._tracked: set[str] = set()
        # Hot spares removed for lack of beats; a beat from one re-admits it (sweep-refreshed).
        self._lapsed: set[str] = set()
        self._pending: set[asyncio.Future[None]] = set()
        # Depth checks run from RPCs, background tasks after reservations and the sweeper.
        # One at a time: a check that read the inventory earlier must not set the gauge (or
        # judge the low alarm) after a check that read it later.
        self._depth_lock = asyncio.Lock()
        registry = ctx.metrics.registry
        self.available = Gauge(
            "spares_available",
            "Idle spare GPUs on healthy, unquarantined nodes",
            ["cluster", "nvlink_domain"],
            registry=registry,
        )
        self.reservations = Counter(
            "spare_reservations_total",
            "Reservations answered, by outcome",
            ["outcome"],
            registry=registry,
        )

    # ----------------------------------------------------------------- events out

    async def _publish(self, event: Event, subject: str) -> None:
        # The state change is already committed; a publish that fails is logged, and the
        # inventory (list/get/depth) stays the source of truth.
        try:
            await self.ctx.bus.publish(event, subject, retry_for=5.0)
        except Exception as exc:
            self.log.warning("publish %s failed: %r", subject, exc)

    async def _released(self, ends: Iterable[LeaseEnd]) -> None:
        for end in ends:
            await self._publish(
                SpareReleased(
                    event_id=make_event_id("spare_released", end.lease_id),
                    source=SERVICE,
                    lease_id=end.lease_id,
                    slot_id=end.slot_id,
                    reason=end.reason,
                ),
                Subjects.SPARE_RELEASED,
            )

    async def check_depth(
        self, cluster: str | None = None, nvlink_domain: str | None = None
    ) -> list[dict[str, Any]]:
        """Refresh the gauge of the matching domains and raise/clear their low alarms."""
        async with self._depth_lock:
            return await self._check_depth(cluster, nvlink_domain)

    async def _check_depth(
        self, cluster: str | None, nvlink_domain: str | None
    ) -> list[dict[str, Any]]:
        rows = await self.inventory.depth(cluster, nvlink_domain)
        out = []
        for row in rows:
            floor = floor_for(self.floors, row.cluster, row.nvlink_domain)
            self.available.labels(row.cluster, row.nvlink_domain).set(row.available)
            since = await self.inventory.was_low(row.cluster, row.nvlink_domain)
            change = pool_low_change(row.available, floor, since is not None)
            if change == "low":
                since = await self.inventory.mark_low(
                    row.cluster, row.nvlink_domain, int(time.time() * 1000)
                )
                self.log.warning(
                    "spare pool low",
                    extra={
                        "cluster": row.cluster,
                        "nvlink_domain": row.nvlink_domain,
                        "available": row.available,
                        "floor": floor,
                    },
                )
                await self._publish(
                    SparePoolLow(
                        event_id=make_event_id(
                            "spare_pool_low", row.cluster, row.nvlink_domain, since
                        ),
                        source=SERVICE,
                        cluster=row.cluster,
                        nvlink_domain=row.nvlink_domain,
                        available=row.available,
                        floor=floor,
                    ),
                    Subjects.SPARE_POOL_LOW,
                )
            elif change == "recovered":
                await self.inventory.clear_low(row.cluster, row.nvlink_domain)
            out.append(
                {
                    "cluster": row.cluster,
                    "nvlink_domain": row.nvlink_domain,
                    "available": row.available,
                    "floor": floor,
                    "low": floor > 0 and row.available < floor,
                }
            )
        return out

    async def _check_slots(self, slots: Iterable[SlotView | SpareSlot]) -> None:
        seen: set[tuple[str, str]] = set()
        for item in slots:
            slot = item.slot if isinstance(item, SlotView) else item
            key = (slot.cluster, slot.nvlink_domain)
            if key not in seen:
                seen.add(key)
                await self.check_depth(*key)

    # ----------------------------------------------------------------- RPC verbs

    async def register(self, body: dict[str, Any]) -> dict[str, Any]:
        """``register``: a SpareSlot's fields; ``slot_id`` defaults to ``cluster:node:gpu``."""
        data = dict(body)
        if not data.get("slot_id"):
            # Validate first so a missing node or gpu is named, then derive the usual id.
            probe = SpareSlot.model_validate({**data, "slot_id": "-"})
            data["slot_id"] = default_slot_id(probe.cluster, probe.node, probe.gpu)
        slot = SpareSlot.model_validate(data)
        problem = registration_problem(slot)
        if problem:
            raise RequestInvalid(problem[1], problem[0])
        view, previous = await self.inventory.register(slot)
        if view.slot.state.value == "hot" and view.slot.member_id:
            self._tracked.add(view.slot.member_id)
        self.log.info(
            "slot registered", extra={"slot_id": slot.slot_id, "state": view.slot.state.value}
        )
        await self._check_slots([view])
        return {"slot": view.to_json(), "previous_state": previous}

    async def reserve(self, body: dict[str, Any]) -> dict[str, Any]:
        """``reserve``: lease the best spare for a job (see ``rules.pick_spare``)."""
        request = ReserveRequest.model_validate(body)
        outcome = await self.inventory.reserve(request)
        await self._released(outcome.expired)
        if outcome.expired:
            await self.check_depth(request.cluster)
        if outcome.error is not None or outcome.lease is None:
            self.reservations.labels(
                "no_fit" if isinstance(outcome.error, NotFound) else "conflict"
            ).inc()
            raise outcome.error or NotFound("no spare fits", None)
        lease = outcome.lease
        self.reservations.labels("replayed" if lease.replayed else "granted").inc()
        # The lease is committed (the inventory is the source of truth): answer now. The
        # reply is on the path of a migrating job's stall; the audit event (JetStream, fsync)
        # and the depth alarm are not, so they follow it instead of holding it up.
        self._background(self._after_reserve(lease))
        return lease.to_json()

    async def _after_reserve(self, lease: Lease) -> None:
        await self._publish(
            SpareReserved(
                event_id=make_event_id("spare_reserved", lease.lease_id),
                source=SERVICE,
                lease_id=lease.lease_id,
                slot=lease.slot.slot,
                job_id=lease.job_id,
                expires_at=lease.expires_at,
            ),
            Subjects.SPARE_RESERVED,
        )
        await self._check_slots([lease.slot])

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._pending.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Future[None]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.warning("after a reservation: %r", task.exception())

    async def drain(self) -> None:
        """Wait for the work that follows answered reservations (shutdown, tests)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def confirm(self, body: dict[str, Any]) -> dict[str, Any]:
        """``confirm``: the leased slot is now in use by the job."""
        request = LeaseRequest.model_validate(body)
        view, expired, error = await self.inventory.confirm(request.lease_id)
        await self._released(expired)
        if error is not None or view is None:
            raise error or NotFound(f"no lease {request.lease_id}", "lease_id")
        return {"lease_id": request.lease_id, "slot": view.to_json()}

    async def release(self, body: dict[str, Any]) -> dict[str, Any]:
        """``release``: the slot goes back to the state it had before the lease."""
        request = ReleaseRequest.model_validate(body)
        view, ended, outcome = await self.inventory.release(request.lease_id, request.reason)
        if ended is not None:
            await self._released([ended])
        if view is not None:
            await self._check_slots([view])
        return {
            "lease_id": request.lease_id,
            "outcome": outcome,
            "slot": view.to_json() if view else None,
        }

    async def list_(self, body: dict[str, Any]) -> dict[str, Any]:
        """``list``: ``{items, next_cursor}`` in slot_id order."""
        request = ListRequest.model_validate(body)
        items, cursor = await self.inventory.list_slots(
            cluster=request.cluster,
            state=request.state.value if request.state else None,
            limit=request.limit,
            cursor=request.cursor,
        )
        return {"items": [v.to_json() for v in items], "next_cursor": cursor}

    async def get(self, body: dict[str, Any]) -> dict[str, Any]:
        """``get``: one slot, why it is excluded (if it is), and its transitions."""
        request = GetRequest.model_validate(body)
        view = await self.inventory.get_slot(request.slot_id)
        if view is None:
            history = await self.inventory.history(request.slot_id)
            if history and history[-1].get("to") == "removed":
                raise NotFound(
                    f"slot {request.slot_id} left the pool: {history[-1].get('reason')}", "slot_id"
                )
            raise NotFound(
                f"no slot {request.slot_id} in the spare inventory; list the slots or register it",
                "slot_id",
            )
        out = view.to_json()
        out["excluded_by"] = await self.inventory.exclusion_of(view.slot)
        out["history"] = await self.inventory.history(request.slot_id)
        return out

    async def quarantine(self, body: dict[str, Any]) -> dict[str, Any]:
        """``quarantine``: a node's slots (or one GPU's) leave service; leases are revoked."""
        request = QuarantineRequest.model_validate(body)
        outcome = await self.inventory.quarantine(
            request.node,
            gpu=request.gpu,
            cluster=request.cluster,
            reason=request.reason,
            rma=request.rma,
        )
        state = "rma" if request.rma else "quarantined"
        if not outcome.known:
            where = f" of cluster {request.cluster}" if request.cluster else ""
            raise NotFound(
                f"node {request.node} has no slots in the spare inventory{where}; "
                f"it is remembered as excluded, so slots registered on it later "
                f"start {state}",
                "node",
            )
        await self._released(outcome.revoked)
        for view in outcome.slots:
            s = view.slot
            await self._publish(
                SpareQuarantined(
                    event_id=make_event_id("spare_quarantined", s.slot_id, state, outcome.since_ms),
                    source=SERVICE,
                    slot_id=s.slot_id,
                    cluster=s.cluster,
                    node=s.node,
                    gpu=s.gpu,
                    state=state,
                    reason=request.reason,
                ),
                Subjects.SPARE_QUARANTINED,
            )
        if not outcome.slots:
            await self._publish(
                SpareQuarantined(
                    event_id=make_event_id(
                        "spare_quarantined",
                        request.cluster or "*",
                        request.node,
                        request.gpu,
                        state,
                        outcome.since_ms,
                    ),
                    source=SERVICE,
                    cluster=request.cluster or self.settings.cluster,
                    node=request.node,
                    gpu=request.gpu,
                    state=state,
                    reason=request.reason,
                ),
                Subjects.SPARE_QUARANTINED,
            )
        self.log.warning(
            "node quarantined",
            extra={
                "node": request.node,
                "gpu": request.gpu,
                "state": state,
                "reason": request.reason,
                "slots": len(outcome.slots),
            },
        )
        await self._check_slots(outcome.slots)
        return {
            "node": request.node,
            "cluster": request.cluster,
            "gpu": request.gpu,
            "state": state,
            "reason": request.reason,
            "slots": [v.to_json() for v in outcome.slots],
            "changed": outcome.changed,
            "revoked_leases": [e.lease_id for e in outcome.revoked],
        }

    async def return_(self, body: dict[str, Any]) -> dict[str, Any]:
        """``return``: quarantined/RMA slots back to idle; the node is no longer excluded."""
        request = ReturnRequest.model_validate(body)
        returned = await self.inventory.return_to_service(
            request.node, gpu=request.gpu, cluster=request.cluster, reason=request.reason
        )
        still: dict[str, str] = {}
        for view in returned:
            health = (await self.inventory.exclusion_of(view.slot)).get("health")
            if health:
                still[view.slot.slot_id] = health
        await self._check_slots(returned)
        return {
            "node": request.node,
            "returned": [v.to_json() for v in returned],
            # The detector's verdict still keeps these out until it reports them healthy.
            "still_unhealthy": still,
        }

    async def depth(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """``depth``: ``[{cluster, nvlink_domain, available, floor}]``."""
        request = DepthRequest.model_validate(body)
        return await self.check_depth(request.cluster)

    # ----------------------------------------------------------------- events in

    async def on_event(self, event: Event, delivery: Delivery) -> None:
        """The durable consumer ``spare-pool``: node health and finished jobs."""
        del delivery
        if isinstance(event, NodeHealthChanged):
            await self.inventory.set_health(
                event.cluster, event.node, event.gpu, event.health.value
            )
            await self.check_depth(event.cluster)
        elif isinstance(event, JobFinished):
            outcome = await self.inventory.job_finished(
                event.job_id, f"job {event.job_id} finished ({event.outcome})"
            )
            await self.inventory.forget_lapsed(event.job_id)
            self._lapsed = await self.inventory.lapsed_members()
            await self._released(outcome.ended)
            if outcome.removed or outcome.freed:
                self.log.info(
                    "job's spares let go",
                    extra={
                        "job_id": event.job_id,
                        "removed": outcome.removed,
                        "freed": outcome.freed,
                    },
                )
                await self.check_depth()

    async def on_heartbeat(self, msg: Msg) -> None:
        """Core ``tr.hb.>``: a hot spare's beat keeps it in the pool."""
        try:
            beat = Heartbeat.model_validate_json(msg.data)
        except ValidationError:
            return  # loss-tolerant stream: a malformed beat is simply not a beat
        if beat.kind == "liveness" and beat.member_id in self._lapsed:
            await self._readmit(beat)
            return
        if beat.kind != "liveness" or beat.member_id not in self._tracked:
            # Step beats come from ranks; a spare that took a rank is no longer tracked.
            return
        try:
            await self.inventory.heartbeat(beat.member_id, self.settings.spare_heartbeat_timeout_s)
        except Exception as exc:
            self.log.warning("heartbeat of %s not recorded: %r", beat.member_id, exc)

    async def _readmit(self, beat: Heartbeat) -> None:
        """A hot spare removed for lack of beats beats again: register it again if it may.

        A spare that may not come back (it holds a rank, its job's generation names it) is
        no longer waiting as a spare: its kept registration is dropped. One that may, and
        whose registration fails (Redis, the slot taken meanwhile), keeps it for its next
        beat after the next sweep.
        """
        self._lapsed.discard(beat.member_id)  # listed again by the next sweep if kept
        try:
            kept = await self.inventory.lapsed(beat.member_id)
            found = None
            if kept is not None and beat.rank is None and beat.job_id == kept.job_id:
                found = await self.ctx.bus.get_generation(beat.job_id)
            problem = readmission_problem(beat, kept, found[0] if found else None)
            if problem is not None:
                await self.inventory.forget_lapsed_member(beat.member_id)
                self.log.info(
                    "hot spare stays out of the pool: %s",
                    problem,
                    extra={"member_id": beat.member_id, "job_id": beat.job_id},
                )
                return
            assert kept is not None
            try:
                view, _ = await self.inventory.register(kept)
            except Conflict as exc:  # its slot was registered again meanwhile, for good
                await self.inventory.forget_lapsed_member(beat.member_id)
                self.log.warning("hot spare %s not re-admitted: %s", beat.member_id, exc)
                return
            await self.inventory.forget_lapsed_member(beat.member_id)
        except Exception as exc:  # Redis or NATS: its next beat after the next sweep retries
            self.log.warning("hot spare %s not re-admitted: %r", beat.member_id, exc)
            return
        self._tracked.add(beat.member_id)
        await self.inventory.heartbeat(beat.member_id, self.settings.spare_heartbeat_timeout_s)
        self.log.warning(
            "hot spare back in the pool: it beats again",
            extra={"member_id": beat.member_id, "slot_id": view.slot.slot_id},
        )
        await self._check_slots([view])

    # ----------------------------------------------------------------- sweeper

    async def sweep_once(self) -> None:
        """Expire due leases, drop silent hot spares, publish what ended."""
        outcome = await self.inventory.sweep()
        self._tracked = await self.inventory.tracked_members()
        self._lapsed = await self.inventory.lapsed_members()
        await self._released(outcome.expired)
        for removed in outcome.removed:
            self.log.warning("hot spare left the pool: no heartbeat", extra=removed)
        if outcome.expired or outcome.removed:
            await self.check_depth()

    async def run_sweeper(self) -> None:
        """The background loop: sweep every interval, refresh the depth gauges now and then."""
        interval = self.settings.spare_sweep_interval_s
        last_refresh = 0.0
        while True:
            try:
                await self.sweep_once()
                if time.monotonic() - last_refresh >= self.settings.spare_depth_refresh_s:
                    await self.check_depth()
                    last_refresh = time.monotonic()
                self.ctx.readiness["inventory"] = "ok"
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.ctx.readiness["inventory"] = f"sweep failing: {exc!r}"[:200]
                self.log.warning("sweep failed: %r", exc)
            await asyncio.sleep(interval)


async def setup(ctx: ServiceContext) -> None:
    """Register the spare pool's verbs, consumer, heartbeat subscription and sweeper."""
    settings = pool_settings(ctx.settings)
    inventory = SpareInventory(
        ctx.redis, ctx.prefix, heartbeat_grace_s=settings.spare_heartbeat_grace_s
    )
    pool = SparePool(ctx, settings, inventory)
    verbs = {
        "register": pool.register,
        "reserve": pool.reserve,
        "confirm": pool.confirm,
        "release": pool.release,
        "list": pool.list_,
        "get": pool.get,
        "quarantine": pool.quarantine,
        "return": pool.return_,
        "depth": pool.depth,
    }
    for verb, handler in verbs.items():
        await ctx.serve(verb, handler)
    await ctx.consume("spare-pool", pool.on_event)
    await ctx.bus.subscribe_core(Subjects.HEARTBEATS_ALL, pool.on_heartbeat, queue=HEARTBEAT_QUEUE)
    with contextlib.suppress(Exception):
        await pool.check_depth()
    ctx.readiness["inventory"] = "ok"
    ctx.spawn(pool.run_sweeper(), "spare-pool-sweeper")
    ctx.closers.append(pool.drain)


__all__ = ["SparePool", "SparePoolSettings", "pool_settings", "setup"]
