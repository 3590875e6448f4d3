"""The central detector: telemetry, heartbeats and agent reports in, faults and node health out.

:class:`Detector` is one replica, put together from one mixin per concern (state and
metrics in ``core.py``):

- ``ingest.py``: routing to the owning replica, the telemetry queue, telemetry and heartbeats;
- ``hardware.py``: GPU findings to faults, lemon score, circuit breaker;
- ``inventory.py``: the node inventory written to Redis, and the fleet gauges;
- ``liveness.py``: the heartbeat sweeps (worker lost to silence, hangs, stragglers);
- ``reports.py``: the durable consumer (job directory, exit and error reports);
- ``queries.py``: the RPC verbs;
- ``faults.py``: the one builder of ``FaultDetected``.

This module wires them: subscriptions, the consumer, the RPC verbs and the background
loops. Handlers are thin: they decode, update the owner's state, call the pure rules of
:mod:`services.detector.rules`, and publish the first finding of each episode as one
``FaultDetected``. See README.md for how replicas share the work.
"""

from __future__ import annotations

import asyncio

from services.detector.core import QUEUE_GROUP, SERVICE
from services.detector.ingest import FORWARD_PREFIX, FORWARD_PREFIX_CRITICAL, IngestMixin
from services.detector.inventory import INVENTORY_CHUNK
from services.detector.liveness import LivenessMixin
from services.detector.queries import QueriesMixin
from services.detector.reports import ReportsMixin
from services.detector.settings import DetectorSettings
from torchrelay.bus import Bus
from torchrelay.contract import Subjects
from torchrelay.service import ServiceContext
from torchrelay.settings import load_settings


class Detector(IngestMixin, LivenessMixin, ReportsMixin, QueriesMixin):
    """One detector replica."""

    async def start(self) -> None:
        """Subscribe, consume and serve (called from ``setup``)."""
        ctx = self.ctx
        # Open a few Redis connections now: a fault's concurrent reads must not wait for a
        # new connection's handshake (and redis-py's package-metadata lookup for it).
        await asyncio.gather(*(ctx.redis.ping() for _ in range(4)))
        await self.membership.beat()
        rid = self.membership.replica_id
        await self.bus.subscribe_core(Subjects.TELEMETRY_ALL, self._on_telemetry, queue=QUEUE_GROUP)
        await self.bus.subscribe_core(
            Subjects.HEARTBEATS_ALL, self._on_heartbeat, queue=QUEUE_GROUP
        )
        await self.bus.subscribe_core(f"{FORWARD_PREFIX}.{rid}.>", self._on_forwarded)
        # Critical telemetry on a connection of its own: on the shared one an XID would wait
        # behind every routine batch already in the socket and the server's send buffer.
        settings = self.settings
        creds = str(settings.nats_credentials) if settings.nats_credentials else None
        self.critical_bus = await Bus.connect(
            settings.nats_url,
            f"{SERVICE}-critical",
            credentials=creds,
            timeout=settings.connect_timeout_s,
            metrics=ctx.metrics,
        )
        ctx.closers.append(self.critical_bus.close)
        await self.critical_bus.subscribe_core(
            Subjects.TELEMETRY_CRITICAL_ALL, self._on_critical, queue=QUEUE_GROUP
        )
        await self.critical_bus.subscribe_core(
            f"{FORWARD_PREFIX_CRITICAL}.{rid}", self._on_forwarded_critical
        )
        await ctx.consume("detector-reports", self.handle_report)
        for verb, handler in (
            ("cluster_list", self.rpc_cluster_list),
            ("node_list", self.rpc_node_list),
            ("node_get", self.rpc_node_get),
            ("node_return", self.rpc_node_return),
        ):
            await ctx.serve(verb, handler)
        ctx.spawn(self._membership_loop(), "detector-membership")
        ctx.spawn(self._telemetry_worker(), "detector-telemetry")
        ctx.spawn(self._sweep_loop(), "detector-sweep")
        ctx.spawn(self._inventory_loop(), "detector-inventory")
        ctx.spawn(self._fleet_gauge_loop(), "detector-fleet-gauges")
        ctx.closers.append(self.drain)
        ctx.closers.append(self.membership.leave)
        ctx.readiness["replica"] = rid

    async def _membership_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                if await self.membership.beat():
                    self.log.info("detector replicas: %s", ",".join(self.membership.replicas))
            except Exception as exc:
                self.log.warning("membership heartbeat failed: %r", exc)


async def setup(ctx: ServiceContext) -> None:
    """Register the detector's subscriptions, consumer and RPC verbs on ``ctx``."""
    settings = (
        ctx.settings
        if isinstance(ctx.settings, DetectorSettings)
        else load_settings(DetectorSettings)
    )
    detector = Detector(ctx, settings)
    await detector.start()
    ctx.readiness["detector"] = "ok"


__all__ = ["INVENTORY_CHUNK", "Detector", "DetectorSettings", "setup"]
