"""What one detector replica holds: its stores, its in-memory state and its metrics.

The replica's behaviour is split by concern into mixins over :class:`DetectorCore`, put
together as :class:`services.detector.service.Detector`:

- ``ingest.py``: telemetry and heartbeats coming in (routing to the owning replica, the
  critical-first queue, decoding, the rules per sample);
- ``hardware.py``: a GPU finding becoming a fault, and its node effects (lemon score,
  circuit breaker, ``NodeHealthChanged``);
- ``inventory.py``: the periodic inventory write to Redis, and the fleet gauges;
- ``liveness.py``: the sweeps over heartbeats (worker lost to silence, hangs, stragglers);
- ``reports.py``: the durable consumer (job directory, agents' and launchers' reports);
- ``queries.py``: the RPC verbs (``cluster_list``, ``node_list``, ``node_get``,
  ``node_return``);
- ``faults.py``: the one builder of ``FaultDetected``, and ``worker_lost`` (opened from
  both liveness and reports).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque

from prometheus_client import Counter, Gauge, Histogram

from services.detector.rules import GpuWindows
from services.detector.settings import DetectorSettings
from services.detector.state import (
    EpisodeStore,
    JobActivity,
    JobDirectory,
    Membership,
    NodeRegistry,
)
from torchrelay.bus import Bus
from torchrelay.service import ServiceContext

SERVICE = "detector"
QUEUE_GROUP = "detector"


# What the inventory keeps of a GPU's last routine sample:
# (backend, model, temperature_c, power_w, sample ts, slow_factor).
GpuSummary = tuple[str, str | None, float | None, float | None, float, float | None]


class DetectorCore:
    """The state shared by the detector's mixins (one replica)."""

    # The connection for critical telemetry, opened by ``start``.
    critical_bus: Bus

    def __init__(self, ctx: ServiceContext, settings: DetectorSettings) -> None:
        self.ctx = ctx
        self.bus = ctx.bus
        self.log = ctx.log
        self.settings = settings
        self.cfg = settings.rules()
        prefix = ctx.prefix
        self.episodes = EpisodeStore(ctx.redis, prefix, self.cfg)
        self.jobs = JobDirectory(ctx.redis, prefix)
        self.nodes = NodeRegistry(ctx.redis, prefix, self.cfg)
        replica = settings.detector_replica_id or uuid.uuid4().hex[:12]
        self.membership = Membership(ctx.redis, prefix, replica)
        self.gpus: dict[tuple[str, str, int], GpuWindows] = {}
        # (cluster, node) -> gpu -> last sample; flushed to Redis by the inventory task.
        # Only scalars (a tuple of them is not tracked by the garbage collector): keeping the
        # samples themselves made full collections scan ~10 objects per GPU, 100+ ms each.
        self.latest: dict[tuple[str, str], dict[int, GpuSummary]] = {}
        self.dirty: set[tuple[str, str]] = set()
        self.activity: dict[str, JobActivity] = {}
        self.inflight: set[asyncio.Future[None]] = set()
        self._critical: deque[tuple[str, bytes, dict[str, str]]] = deque()
        self._routine: deque[tuple[str, bytes, dict[str, str]]] = deque()
        self._work = asyncio.Event()
        self._busy = False
        self.recent_loss: dict[str, float] = {}  # job -> when one of its members was lost
        self.recent_change: dict[str, float] = {}  # job -> when its generation last changed
        reg = ctx.metrics.registry
        self.m_samples = Counter(
            "detector_samples_total", "Telemetry samples evaluated", registry=reg
        )
        self.m_faults = Counter(
            "detector_faults_total", "FaultDetected published", ["kind"], registry=reg
        )
        self.m_breaker = Counter(
            "detector_breaker_refusals_total",
            "Node health changes refused by the circuit breaker",
            registry=reg,
        )
        self.m_dropped = Counter(
            "detector_telemetry_dropped_total",
            "Routine telemetry batches dropped because the backlog was full",
            registry=reg,
        )
        self.m_forwarded = Counter(
            "detector_forwarded_total",
            "Messages handed to the owning replica",
            ["kind"],
            registry=reg,
        )
        self.m_latency = Histogram(
            "detector_fault_latency_seconds",
            "From the sample's timestamp to the fault's publish",
            registry=reg,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5),
        )
        # Fleet-wide figures read from Redis by one replica (inventory.py): take the max
        # over replicas, not the sum, since a replica that just handed the count to another
        # may still show its last values until its next refresh.
        self.m_nodes = Gauge(
            "torchrelay_nodes",
            "Nodes seen in telemetry, by cluster and health",
            ["cluster", "health"],
            registry=reg,
        )
        self.m_gpus = Gauge(
            "torchrelay_gpus",
            "GPUs seen in telemetry, by cluster and the health of their node",
            ["cluster", "health"],
            registry=reg,
        )
