"""The central detector: telemetry, heartbeats and agent reports in, faults and node health out.

Handlers are thin: they decode, update the owner's state, call the pure rules of
:mod:`services.detector.rules`, and publish the first finding of each episode as one
``FaultDetected``. See README.md for how replicas share the work.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.detector.rules import (
    TAXONOMY,
    DetectorConfig,
    GpuWindows,
    MemberProgress,
    decide,
    evaluate_sample,
    hang_bound,
    hung_members,
    lemon_weight,
    lost_members,
    straggler_ranks,
)
from services.detector.state import (
    JOB_TTL_S,
    EpisodeStore,
    JobActivity,
    JobDirectory,
    Membership,
    NodeRegistry,
    SlotHolder,
)
from torchrelay.bus import Bus, Delivery, NotFound, validation_message
from torchrelay.contract import (
    AgentReport,
    Event,
    FaultAction,
    FaultDetected,
    FaultKind,
    GenerationChanged,
    Heartbeat,
    JobFinished,
    JobRegistered,
    Name,
    NodeHealth,
    NodeHealthChanged,
    ReportKind,
    Severity,
    Subjects,
    TelemetryBatch,
    TelemetrySample,
    make_event_id,
)
from torchrelay.service import ServiceContext
from torchrelay.settings import ServiceSettings, load_settings

SERVICE = "detector"
QUEUE_GROUP = "detector"
# Internal subject on which a replica hands a batch to the replica that owns its node/job.
FORWARD_PREFIX = "tr.int.detector"
FORWARD_PREFIX_CRITICAL = "tr.int.detector-critical"
FORWARD_SUBJECT_HEADER = "Tr-Subject"
INVENTORY_SILENT_S = 30.0
MAX_QUEUED_BATCHES = 50_000
INVENTORY_CHUNK = 100  # nodes encoded and written per step of an inventory flush
_CRITICAL = b'"critical":true'
_CRITICAL_SPACED = b'"critical": true'


# What the inventory keeps of a GPU's last routine sample:
# (backend, model, temperature_c, power_w, sample ts, slow_factor).
GpuSummary = tuple[str, str | None, float | None, float | None, float, float | None]


# How long after a member was lost, or the generation changed, stalls are not hangs.
HANG_GRACE_AFTER_DISRUPTION_S = 120.0


class DetectorSettings(ServiceSettings):
    """Settings of the detector service (environment ``TORCHRELAY_DETECTOR_*``)."""

    # Backstop only: a SIGKILL is seen at once through the launcher's exit report and the
    # peers' failed collectives; silence catches hangs and lost nodes. 2 s gave false
    # positives on a loaded 2-core machine while ranks formed their groups.
    detector_heartbeat_timeout_s: float = Field(default=5.0, gt=0)
    detector_episode_quiet_s: float = Field(default=60.0, gt=0)
    detector_hang_floor_s: float = Field(default=10.0, gt=0)
    detector_hang_factor: float = Field(default=10.0, gt=0)
    detector_straggler_ratio: float = Field(default=1.3, gt=1)
    detector_straggler_sustain_s: float = Field(default=5.0, ge=0)
    detector_breaker_max_share: float = Field(default=0.25, gt=0, le=1)
    detector_breaker_min_nodes: int = Field(default=1, ge=0)
    detector_lemon_threshold: float = Field(default=3.0, gt=0)
    detector_sweep_interval_s: float = Field(default=0.25, gt=0)
    detector_inventory_interval_s: float = Field(default=5.0, gt=0)
    detector_replica_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_\-]+$")

    def rules(self) -> DetectorConfig:
        """The rules' thresholds from these settings."""
        return DetectorConfig(
            heartbeat_timeout_s=self.detector_heartbeat_timeout_s,
            episode_quiet_s=self.detector_episode_quiet_s,
            hang_floor_s=self.detector_hang_floor_s,
            hang_factor=self.detector_hang_factor,
            straggler_ratio=self.detector_straggler_ratio,
            straggler_sustain_s=self.detector_straggler_sustain_s,
            breaker_max_share=self.detector_breaker_max_share,
            breaker_min_nodes=self.detector_breaker_min_nodes,
            lemon_threshold=self.detector_lemon_threshold,
        )


class NodeQuery(BaseModel):
    """Body of ``node_get`` / ``node_return``."""

    model_config = ConfigDict(extra="ignore")
    node: Name
    cluster: Name | None = None


class NodeListQuery(BaseModel):
    """Body of ``node_list``."""

    model_config = ConfigDict(extra="ignore")
    cluster: Name | None = None


def _assignment(
    got: tuple[int, list[dict[str, Any]]] | None,
    member_id: str,
    rank: int | None,
    node: str,
    gpu: int,
) -> tuple[int, str, int] | None:
    """(rank, node, gpu) of a member in the newest generation ``got``.

    The report's own values for a job the detector never saw registered; None when the
    member holds no rank (a spare, or a member fenced out by a newer generation).
    """
    if got is None:
        return None if rank is None else (rank, node, gpu)
    for a in got[1]:
        if a["member_id"] == member_id:
            return int(a["rank"]), str(a["node"]), int(a["gpu"])
    return None


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


class Detector:
    """One detector replica."""

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

    # ----------------------------------------------------------------- wiring

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

    # ----------------------------------------------------------------- routing

    async def _route(self, msg: Msg, key: str, kind: str) -> bool:
        """Hand the message to the replica owning ``key``; True if it was not ours."""
        owner = self.membership.owner(key)
        if owner == self.membership.replica_id:
            return False
        headers = dict(msg.headers or {})
        headers[FORWARD_SUBJECT_HEADER] = msg.subject
        await self.bus.nc.publish(f"{FORWARD_PREFIX}.{owner}.{kind}", msg.data, headers=headers)
        self.m_forwarded.labels(kind).inc()
        return True

    async def _on_telemetry(self, msg: Msg) -> None:
        # The subject names the node: every batch of a node goes to the node's owner.
        if await self._route(msg, msg.subject, "tel"):
            return
        self._enqueue(msg.subject, msg.data, msg.headers)

    async def _on_critical(self, msg: Msg) -> None:
        # Same owner as the node's routine telemetry (its GPUs' state lives there).
        cluster_node = msg.subject.removeprefix("tr.crit.")
        owner = self.membership.owner(f"tr.tel.{cluster_node}")
        if owner != self.membership.replica_id:
            headers = dict(msg.headers or {})
            headers[FORWARD_SUBJECT_HEADER] = msg.subject
            try:
                # A request, not a publish: an owner that died since the last membership beat
                # must not swallow an XID. Without an answer this replica evaluates it.
                await self.critical_bus.nc.request(
                    f"{FORWARD_PREFIX_CRITICAL}.{owner}",
                    msg.data,
                    timeout=0.5,
                    headers=headers,
                )
                self.m_forwarded.labels("crit").inc()
                return
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError):
                self.log.warning(
                    "replica %s did not take a critical batch of %s; evaluating it here",
                    owner,
                    cluster_node,
                )
        self._enqueue(msg.subject, msg.data, msg.headers, critical=True)

    async def _on_forwarded_critical(self, msg: Msg) -> None:
        headers = dict(msg.headers or {})
        subject = headers.pop(FORWARD_SUBJECT_HEADER, msg.subject)
        self._enqueue(subject, msg.data, headers, critical=True)
        if msg.reply:
            await msg.respond(b"ok")

    def _enqueue(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str] | None,
        *,
        critical: bool = False,
    ) -> None:
        """Queue a batch for the telemetry worker; critical batches (XIDs) jump the queue.

        Telemetry is loss-tolerant (core NATS): when the backlog is full the oldest routine
        batch is dropped and counted, never a critical one.
        """
        item = (subject, data, headers or {})
        if critical or _CRITICAL in data or _CRITICAL_SPACED in data:
            self._critical.append(item)
        else:
            if len(self._routine) >= MAX_QUEUED_BATCHES:
                self._routine.popleft()
                self.m_dropped.inc()
            self._routine.append(item)
        self._work.set()

    async def _telemetry_worker(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            done = 0
            while self._critical or self._routine:
                item = self._critical.popleft() if self._critical else self._routine.popleft()
                self._busy = True
                try:
                    await self.handle_telemetry(*item)
                except Exception:
                    self.log.exception("telemetry batch on %s failed", item[0])
                finally:
                    self._busy = False
                done += 1
                if done % 4 == 0 or self.inflight:
                    # Let the subscriptions queue (critical ones go first) and, while faults
                    # are being published, let their round trips go on after every batch.
                    await asyncio.sleep(0)

    async def _on_heartbeat(self, msg: Msg) -> None:
        # One owner per job: the straggler and hang rules need all of its ranks.
        if await self._route(msg, msg.subject, "hb"):
            return
        await self.handle_heartbeat(msg.subject, msg.data, dict(msg.headers or {}))

    async def _on_forwarded(self, msg: Msg) -> None:
        headers = dict(msg.headers or {})
        subject = headers.pop(FORWARD_SUBJECT_HEADER, msg.subject)
        if msg.subject.endswith(".tel"):
            self._enqueue(subject, msg.data, headers)
        elif msg.subject.endswith(".hb"):
            await self.handle_heartbeat(subject, msg.data, headers)

    # ----------------------------------------------------------------- telemetry

    async def handle_telemetry(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        """Evaluate one telemetry batch; a malformed one goes to ``tr.dlq.detector``."""
        try:
            batch = TelemetryBatch.model_validate_json(data)
        except ValidationError as exc:
            text, _ = validation_message(exc)
            await self.bus.dead_letter(subject, data, f"invalid TelemetryBatch: {text}", headers)
            return
        expected = (
            Subjects.telemetry_critical(batch.cluster, batch.node)
            if subject.startswith("tr.crit.")
            else Subjects.telemetry(batch.cluster, batch.node)
        )
        if subject.startswith(("tr.tel.", "tr.crit.")) and subject != expected:
            await self.bus.dead_letter(
                subject,
                data,
                f"refused: batch of {batch.cluster}/{batch.node} published on "
                f"{subject} (a node agent publishes on {expected})",
                headers,
            )
            return
        node_key = (batch.cluster, batch.node)
        # A sample of another node inside this node's batch is not this agent's to say.
        samples = [s for s in batch.samples if s.node == batch.node and s.cluster == batch.cluster]
        self.m_samples.inc(len(samples))
        latest = self.latest.get(node_key)
        changed = latest is None
        if latest is None:
            latest = self.latest[node_key] = {}
        if not batch.critical:
            for s in samples:
                changed = changed or s.gpu not in latest
                latest[s.gpu] = (
                    s.backend,
                    s.gpu_model,
                    s.temperature_c,
                    s.power_w,
                    s.ts.timestamp(),
                    s.extra.get("slow_factor"),
                )
        self.dirty.add(node_key)
        if changed:
            # A new node (or GPU) is in the inventory at once: it counts for the breaker.
            await self._flush_inventory({node_key})
        for s in samples:
            key = (s.cluster, s.node, s.gpu)
            w = self.gpus.get(key)
            if w is None:
                w = self.gpus[key] = GpuWindows(self.cfg)
            for f in evaluate_sample(w, s, self.cfg):
                ep_key = self.episodes.key(s.cluster, s.node, s.gpu, f.kind.value)
                if self.episodes.observe(ep_key, s.ts.timestamp()):
                    # Off the telemetry path: Redis and JetStream round trips must not hold
                    # up the next batch (and its faults) behind this one.
                    self._spawn(self._gpu_finding(s, f.kind, f.signal, f.evidence, ep_key))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self.inflight.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Future[None]) -> None:
        self.inflight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error("fault pipeline failed: %r", task.exception())

    async def drain(self) -> None:
        """Wait for queued telemetry and the faults being published (shutdown, tests)."""
        while self._critical or self._routine or self._busy or self.inflight:
            if self.inflight:
                await asyncio.gather(*list(self.inflight), return_exceptions=True)
            else:
                await asyncio.sleep(0.005)

    async def _gpu_finding(
        self,
        s: TelemetrySample,
        kind: FaultKind,
        signal: str,
        evidence: dict[str, Any],
        key: str,
    ) -> None:
        at = s.ts.timestamp()
        # Who holds the slot is looked up alongside the episode: one round trip less.
        opened, holder = await asyncio.gather(
            self.episodes.sync(key, node_index=self.nodes.episodes_key(s.cluster, s.node)),
            self.jobs.slot_holder(s.cluster, s.node, s.gpu),
        )
        for number, first in opened:
            await self._publish_gpu_fault(s, kind, signal, evidence, number, first, holder, at)

    async def _publish_gpu_fault(
        self,
        s: TelemetrySample,
        kind: FaultKind,
        signal: str,
        evidence: dict[str, Any],
        number: int,
        first: float,
        holder: SlotHolder | None,
        at: float,
    ) -> None:
        d = decide(kind, number, self.cfg)
        fault_id = make_event_id("fault", s.cluster, s.node, s.gpu, kind.value, number)
        ev: dict[str, Any] = {
            "signal": signal,
            **evidence,
            "sample_ts": s.ts.isoformat(),
            "backend": s.backend,
            "gpu_model": s.gpu_model,
            "episode": number,
            "follow_up": d.follow_up,
        }
        if d.escalated:
            ev["escalated"] = (
                f"{kind.value} recurred after reset or return to service "
                f"(episode {number}): quarantine for hardware inspection"
            )
        fault = FaultDetected(
            event_id=fault_id,
            source=SERVICE,
            fault_id=fault_id,
            cluster=s.cluster,
            node=s.node,
            gpu=s.gpu,
            kind=kind,
            severity=d.severity,
            action=d.action,
            evidence=ev,
            repeat=number,
            first_seen_at=datetime.fromtimestamp(first, UTC),
            job_id=holder.job_id if holder else None,
            rank=holder.rank if holder else None,
            member_id=holder.member_id if holder else None,
        )
        await self._publish_fault(fault, at)
        if holder is not None and holder.member_id is not None and d.severity != Severity.INFO:
            await self.jobs.note_slot_fault(s.cluster, s.node, s.gpu, fault_id, kind.value)
        if TAXONOMY[kind].hardware:
            await self._node_effects(
                s.cluster, s.node, s.gpu, kind, d.severity, d.node_health, fault_id
            )

    async def _publish_fault(self, fault: FaultDetected, signal_at: float) -> None:
        await self.bus.publish(fault, Subjects.FAULT_DETECTED)
        self.m_faults.labels(fault.kind.value).inc()
        self.m_latency.observe(max(0.0, time.time() - signal_at))
        self.log.warning(
            "fault %s on %s/%s gpu %s job %s rank %s: %s",
            fault.kind.value,
            fault.cluster,
            fault.node,
            fault.gpu,
            fault.job_id,
            fault.rank,
            fault.evidence.get("signal"),
        )

    async def _node_effects(
        self,
        cluster: str,
        node: str,
        gpu: int,
        kind: FaultKind,
        severity: Severity,
        target: NodeHealth | None,
        fault_id: str,
    ) -> None:
        now = time.time()
        score = await self.nodes.add_lemon(cluster, node, lemon_weight(severity), now)
        if score >= self.cfg.lemon_threshold:
            target = NodeHealth.LEMON
        if target is None:
            return
        await self.nodes.mark_gpu(cluster, node, gpu, target, kind.value)
        outcome, previous, out, total = await self.nodes.raise_health(cluster, node, target)
        if outcome == "ok":
            await self.bus.publish(
                NodeHealthChanged(
                    event_id=make_event_id("health", cluster, node, target.value, fault_id),
                    source=SERVICE,
                    cluster=cluster,
                    node=node,
                    health=target,
                    lemon_score=score,
                    gpu=gpu,
                    reason=f"{kind.value} on GPU {gpu} (fault {fault_id})",
                ),
                Subjects.NODE_HEALTH,
            )
        elif outcome == "refused":
            self.m_breaker.inc()
            reason = (
                f"circuit breaker: refused to mark {node} {target.value} after "
                f"{kind.value} on GPU {gpu}: {out} of {total} nodes of cluster "
                f"{cluster} are already out of service (limit "
                f"{self.cfg.breaker_max_share:.0%}); a fleet-wide signal is more likely "
                "a bug or a shared cause - investigate, then node_return nodes"
            )
            self.log.error(reason)
            await self.bus.publish(
                NodeHealthChanged(
                    event_id=make_event_id("breaker", cluster, node, target.value, fault_id),
                    source=SERVICE,
                    cluster=cluster,
                    node=node,
                    health=previous,
                    lemon_score=score,
                    gpu=gpu,
                    reason=reason,
                ),
                Subjects.NODE_HEALTH,
            )

    # ----------------------------------------------------------------- inventory

    async def _inventory_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.detector_inventory_interval_s)
            try:
                await self._flush_inventory()
            except Exception as exc:
                self.log.warning("inventory flush failed: %r", exc)

    async def _flush_inventory(self, only: set[tuple[str, str]] | None = None) -> None:
        if only is None:
            dirty, self.dirty = self.dirty, set()
        else:
            dirty = only
        now = time.time()
        nodes = list(dirty)
        # In chunks, each written before the next is encoded: 2,000 nodes at once held the
        # event loop (and any XID behind it) for 100-370 ms.
        for start in range(0, len(nodes), INVENTORY_CHUNK):
            by_cluster: dict[str, dict[str, dict[str, Any]]] = {}
            for cluster, node in nodes[start : start + INVENTORY_CHUNK]:
                samples = self.latest.get((cluster, node), {})
                by_cluster.setdefault(cluster, {})[node] = {
                    "last_seen": now,
                    "backend": next((g[0] for g in samples.values()), None),
                    "gpus": [
                        {
                            "gpu": gpu,
                            "model": model,
                            "temperature_c": temperature,
                            "power_w": power,
                            "sample_ts": round(ts, 3),
                            **({"slow_factor": slow} if slow is not None else {}),
                        }
                        for gpu, (_, model, temperature, power, ts, slow) in sorted(samples.items())
                    ],
                }
            for cluster, inv in by_cluster.items():
                await self.nodes.record_inventory(cluster, inv)

    # ----------------------------------------------------------------- heartbeats

    async def handle_heartbeat(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        """Track a member's liveness and step progress; malformed beats are dead-lettered."""
        try:
            hb = Heartbeat.model_validate_json(data)
        except ValidationError as exc:
            text, _ = validation_message(exc)
            await self.bus.dead_letter(subject, data, f"invalid Heartbeat: {text}", headers)
            return
        now = time.time()  # silence is measured on this replica's clock, not the sender's
        act = self.activity.get(hb.job_id)
        if act is None:
            act = self.activity[hb.job_id] = JobActivity(hb.job_id)
        act.last_beat = now
        m = act.members.get(hb.member_id)
        if m is None:
            m = act.members[hb.member_id] = MemberProgress(
                hb.member_id, hb.rank, hb.node, hb.gpu, hb.cluster, hb.generation, hb.step, now, now
            )
        m.last_seen = now
        if hb.rank != m.rank or hb.generation > m.generation:
            # A spare taking a rank (or a rank entering a new generation) starts its progress
            # clock now: the time it waited idle is not a hang.
            m.last_progress = now
        m.rank = hb.rank
        m.generation = max(m.generation, hb.generation)
        if hb.step != m.step:
            m.step = hb.step
            m.last_progress = now
        if hb.kind == "step" and hb.step_time_s is not None and hb.rank is not None:
            act.record_step_time(hb.rank, hb.step_time_s, self.cfg.straggler_window)

    async def _sweep_loop(self) -> None:
        interval = self.settings.detector_sweep_interval_s
        previous = time.time()
        while True:
            await asyncio.sleep(interval)
            now = time.time()
            lag = now - previous - interval
            previous = now
            if lag > self.cfg.heartbeat_timeout_s / 4:
                # This replica's own loop was starved: heartbeats may sit unread in the
                # socket. Silence while we were not listening is not the members' silence.
                self.forgive_silence(lag)
                self.log.warning("detector loop lagged %.2fs; heartbeat clocks shifted", lag)
            try:
                await self.sweep(now)
            except Exception:
                self.log.exception("detector sweep failed")

    def forgive_silence(self, seconds: float) -> None:
        """Shift every member's last-heard time forward by ``seconds`` (our own stall)."""
        for act in self.activity.values():
            for m in act.members.values():
                m.last_seen += seconds
                m.last_progress += seconds

    async def sweep(self, now: float) -> None:
        """Run the heartbeat rules (lost, hang, straggler) over every job this replica owns."""
        for job_id, act in list(self.activity.items()):
            if now - act.last_beat > 300.0:
                del self.activity[job_id]
                continue
            for m in lost_members(act.members, now, self.cfg):
                del act.members[m.member_id]  # a later heartbeat brings it back
                await self._member_silent(job_id, m, now)
            # Only ranks can hang: an idle spare makes no step progress by design.
            ranked = {k: m for k, m in act.members.items() if m.rank is not None}
            hang = hung_members(ranked, hang_bound(act.step_times, self.cfg), now, self.cfg)
            if hang is not None:
                await self._hang(job_id, hang.stalled, hang.job_wide, hang.bound_s, now)
            if now - act.last_straggler_check >= 1.0:
                act.last_straggler_check = now
                slow = act.straggler.update(
                    straggler_ranks(act.rank_steps, self.cfg), now, self.cfg
                )
                for rank, evidence in slow.items():
                    await self._straggler(job_id, act, rank, evidence, now)

    async def _current_rank(self, job_id: str, member_id: str, fallback: int | None) -> int | None:
        """The member's rank in the newest generation; heartbeats' rank for unknown jobs."""
        got = await self.jobs.ranks(job_id)
        if got is None:
            return fallback
        for a in got[1]:
            if a["member_id"] == member_id:
                return int(a["rank"])
        return None

    async def _member_silent(self, job_id: str, m: MemberProgress, now: float) -> None:
        if (
            await self.jobs.finished(job_id)
            or await self.jobs.app_error(job_id)
            or await self.jobs.exited(job_id, m.member_id)
        ):
            return
        rank = await self._current_rank(job_id, m.member_id, m.rank)
        if rank is None:
            return  # departed in a newer generation (fenced), or a spare: not a rank lost
        await self._worker_lost(
            job_id,
            m.member_id,
            rank,
            m.cluster,
            m.node,
            m.gpu,
            now,
            {
                "signal": "heartbeats_gone",
                "silent_s": round(now - m.last_seen, 3),
                "timeout_s": self.cfg.heartbeat_timeout_s,
                "last_step": m.step,
                "generation": m.generation,
            },
        )

    async def _worker_lost(
        self,
        job_id: str,
        member_id: str,
        rank: int | None,
        cluster: str,
        node: str,
        gpu: int | None,
        at: float,
        evidence: dict[str, Any],
    ) -> None:
        """One worker_lost per member, whichever signal (exit, silence, peer) comes first."""
        self.recent_loss[job_id] = time.time()
        key = self.episodes.key("member", job_id, member_id, "worker_lost")
        # A process dying on a GPU that just failed is the same failure seen twice: say so,
        # so that the scheduler can count it once. Read with the episode: one round trip.
        (new, _, _), raw = await self.episodes.open_and_get(
            key,
            at,
            self.jobs.slot_fault_key(cluster, node, gpu) if gpu is not None else None,
            quiet_s=float(JOB_TTL_S),
        )
        if not new:
            return
        related = self.jobs.parse_slot_fault(raw)
        fault_id = make_event_id("worker_lost", job_id, member_id)
        row = TAXONOMY[FaultKind.WORKER_LOST]
        if related is not None:
            evidence = {
                **evidence,
                "related_fault_id": related[0],
                "related_fault_kind": related[1],
            }
        await self._publish_fault(
            FaultDetected(
                event_id=fault_id,
                source=SERVICE,
                fault_id=fault_id,
                cluster=cluster,
                node=node,
                gpu=gpu,
                job_id=job_id,
                rank=rank,
                member_id=member_id,
                kind=row.kind,
                severity=row.severity,
                action=row.action,
                evidence=evidence,
                first_seen_at=datetime.fromtimestamp(at, UTC),
            ),
            at,
        )

    async def _hang(
        self, job_id: str, stalled: list[MemberProgress], job_wide: bool, bound: float, now: float
    ) -> None:
        disrupted = max(self.recent_loss.get(job_id, 0.0), self.recent_change.get(job_id, 0.0))
        if now - disrupted < HANG_GRACE_AFTER_DISRUPTION_S:
            # A lost member or a migration in flight explains why the others wait (the
            # group re-forms, a spare receives the state, the policy may wait for a spare).
            return
        # A rank that finished (or exited) makes no progress and still looks alive until its
        # heartbeats time out: that is not a hang.
        stalled = [m for m in stalled if not await self.jobs.exited(job_id, m.member_id)]
        if not stalled:
            return
        row = TAXONOMY[FaultKind.WORKER_HANG]
        if job_wide:
            first = min(stalled, key=lambda m: m.rank if m.rank is not None else 1 << 30)
            step = first.step
            key = self.episodes.key("job", job_id, "worker_hang", step)
            new, _, _ = await self.episodes.open(key, now, quiet_s=float(JOB_TTL_S))
            if not new:
                return
            fault_id = make_event_id("worker_hang", job_id, "job", step)
            await self._publish_fault(
                FaultDetected(
                    event_id=fault_id,
                    source=SERVICE,
                    fault_id=fault_id,
                    cluster=first.cluster,
                    node=first.node,
                    gpu=first.gpu,
                    job_id=job_id,
                    kind=row.kind,
                    severity=Severity.WARNING,
                    action=FaultAction.RECORD,
                    evidence={
                        "signal": "no_step_progress",
                        "job_wide": True,
                        "step": step,
                        "bound_s": round(bound, 3),
                        "members": sorted(m.member_id for m in stalled),
                        "note": "every live rank stalled at the same step; culprit unknown",
                    },
                ),
                now,
            )
            return
        for m in stalled:
            rank = await self._current_rank(job_id, m.member_id, m.rank)
            if rank is None or await self.jobs.finished(job_id):
                continue
            key = self.episodes.key("member", job_id, m.member_id, "worker_hang", m.step)
            new, _, _ = await self.episodes.open(key, now, quiet_s=float(JOB_TTL_S))
            if not new:
                continue
            fault_id = make_event_id("worker_hang", job_id, m.member_id, m.step)
            await self._publish_fault(
                FaultDetected(
                    event_id=fault_id,
                    source=SERVICE,
                    fault_id=fault_id,
                    cluster=m.cluster,
                    node=m.node,
                    gpu=m.gpu,
                    job_id=job_id,
                    rank=rank,
                    member_id=m.member_id,
                    kind=row.kind,
                    severity=row.severity,
                    action=row.action,
                    evidence={
                        "signal": "no_step_progress",
                        "step": m.step,
                        "stalled_s": round(now - m.last_progress, 3),
                        "bound_s": round(bound, 3),
                        "follow_up": row.follow_up,
                    },
                ),
                now,
            )

    async def _straggler(
        self, job_id: str, act: JobActivity, rank: int, evidence: dict[str, float], now: float
    ) -> None:
        holder = next((m for m in act.members.values() if m.rank == rank), None)
        if holder is None:
            return
        key = self.episodes.key("member", job_id, holder.member_id, "straggler")
        new, number, _ = await self.episodes.open(key, now)
        if not new:
            return
        row = TAXONOMY[FaultKind.STRAGGLER]
        fault_id = make_event_id("straggler", job_id, holder.member_id, number)
        await self._publish_fault(
            FaultDetected(
                event_id=fault_id,
                source=SERVICE,
                fault_id=fault_id,
                cluster=holder.cluster,
                node=holder.node,
                gpu=holder.gpu,
                job_id=job_id,
                rank=rank,
                member_id=holder.member_id,
                kind=row.kind,
                severity=row.severity,
                action=row.action,
                repeat=number,
                evidence={"signal": "step_time", **evidence},
            ),
            now,
        )

    # ----------------------------------------------------------------- reports

    async def handle_report(self, event: Event, delivery: Delivery) -> None:
        """The durable consumer: job registry, generations, and agents' failure reports."""
        del delivery
        if isinstance(event, JobRegistered):
            await self.jobs.register(event)
        elif isinstance(event, GenerationChanged):
            await self.jobs.set_generation(event)
            if event.generation > 1:
                # Ranks stall while the group re-forms around the new member: not a hang.
                self.recent_change[event.job_id] = time.time()
        elif isinstance(event, JobFinished):
            await self.jobs.finish(event.job_id)
            self.activity.pop(event.job_id, None)
        elif isinstance(event, AgentReport):
            await self._report(event)

    async def _report(self, r: AgentReport) -> None:
        at = r.occurred_at.timestamp()
        if r.kind == ReportKind.JOINED:
            await self.jobs.add_member(
                r.job_id, r.member_id, r.node, r.gpu, r.role.value, r.cluster
            )
        elif r.kind == ReportKind.FINISHED:
            # A finished rank stops its heartbeats before its process exits (output, teardown):
            # that silence is not a lost worker.
            await self.jobs.mark_exited(r.job_id, r.member_id)
        elif r.kind == ReportKind.WORKER_EXIT:
            try:
                await self._worker_exit(r, at)
            finally:
                # Recorded once the verdict is out: with ``appendfsync always`` a write waits
                # for Redis's fsync, and the fault must not. Heartbeat silence of the member
                # meanwhile finds its worker_lost episode already open.
                await self.jobs.mark_exited(r.job_id, r.member_id)
        elif r.kind == ReportKind.APPLICATION_ERROR:
            await self.jobs.mark_app_error(r.job_id)
            await self._application_error(r, at)
        elif r.kind == ReportKind.COLLECTIVE_FAILED:
            if r.peer_rank is None:
                self.log.info(
                    "collective failed in job %s (%s) without a peer: waiting for "
                    "heartbeats or exits to name the lost rank",
                    r.job_id,
                    r.member_id,
                )
                return
            got, cluster = await self.jobs.ranks_and_cluster(r.job_id)
            peer = next((a for a in got[1] if int(a["rank"]) == r.peer_rank), None) if got else None
            if peer is None:
                return
            await self._worker_lost(
                r.job_id,
                peer["member_id"],
                r.peer_rank,
                cluster,
                peer["node"],
                int(peer["gpu"]),
                at,
                {
                    "signal": "collective_failed",
                    "reported_by": r.member_id,
                    "step": r.step,
                    "error": (r.error or "")[:500],
                },
            )

    async def _worker_exit(self, r: AgentReport, at: float) -> None:
        code = r.exit_code
        # The launcher prefixes its verdict: a process that crashed on its way out after
        # job.finish() ("finished: killed by SIGABRT") lost nothing.
        outcome = (r.error or "").split(":", 1)[0]
        if code in (0, 75) or outcome in ("finished", "fenced"):
            return  # finished, or fenced: nothing was lost
        if code == 1 and r.error:
            await self.jobs.mark_app_error(r.job_id)
            await self._application_error(r, at)
            return
        known = await self.jobs.exit_context(r.job_id)
        if known.app_error or known.finished:
            return  # killed by the launcher after the job failed or finished
        slot = _assignment(known.ranks, r.member_id, r.rank, r.node, r.gpu)
        if slot is None:
            return  # a spare, or a member that no longer holds a rank
        rank, node, gpu = slot
        await self._worker_lost(
            r.job_id,
            r.member_id,
            rank,
            known.cluster,
            node,
            gpu,
            at,
            {"signal": "worker_exit", "exit_code": code, "error": (r.error or "")[:500]},
        )

    async def _application_error(self, r: AgentReport, at: float) -> None:
        key = self.episodes.key("member", r.job_id, r.member_id, "application_error")
        new, _, _ = await self.episodes.open(key, at, quiet_s=float(JOB_TTL_S))
        if not new:
            return
        row = TAXONOMY[FaultKind.APPLICATION_ERROR]
        fault_id = make_event_id("application_error", r.job_id, r.member_id)
        rank = r.rank if r.rank is not None else await self.jobs.rank_of(r.job_id, r.member_id)
        await self._publish_fault(
            FaultDetected(
                event_id=fault_id,
                source=SERVICE,
                fault_id=fault_id,
                cluster=r.cluster,
                node=r.node,
                gpu=r.gpu,
                job_id=r.job_id,
                rank=rank,
                member_id=r.member_id,
                kind=row.kind,
                severity=row.severity,
                action=row.action,
                evidence={
                    "signal": r.kind.value,
                    "exit_code": r.exit_code,
                    "error": (r.error or "")[:2000],
                },
            ),
            at,
        )

    # ----------------------------------------------------------------- rpc

    async def _node_view(
        self, cluster: str, node: str, inv: dict[str, Any] | None, health: NodeHealth, now: float
    ) -> dict[str, Any]:
        gpu_faults = await self.nodes.gpu_health(cluster, node)
        gpus = []
        for g in (inv or {}).get("gpus", []):
            gh = gpu_faults.get(int(g["gpu"]), {})
            gpus.append(
                {**g, "health": gh.get("health", "healthy"), "faults": gh.get("faults", [])}
            )
        last_seen = (inv or {}).get("last_seen")
        return {
            "node": node,
            "cluster": cluster,
            "health": health.value,
            "lemon_score": round(await self.nodes.lemon(cluster, node, now), 4),
            "state": "out_of_service" if self.nodes.out_of_service(health) else "in_service",
            "reporting": last_seen is not None and now - float(last_seen) < INVENTORY_SILENT_S,
            "last_seen": _iso(float(last_seen)) if last_seen else None,
            "backend": (inv or {}).get("backend"),
            "gpus": gpus,
        }

    async def rpc_cluster_list(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """``cluster_list`` -> [{cluster, nodes, gpus, unhealthy}]."""
        del body
        out = []
        for cluster in await self.nodes.clusters():
            inv = await self.nodes.inventory(cluster)
            health = await self.nodes.health_all(cluster)
            out.append(
                {
                    "cluster": cluster,
                    "nodes": len(inv),
                    "gpus": sum(len(v.get("gpus", [])) for v in inv.values()),
                    "unhealthy": sum(1 for h in health.values() if self.nodes.out_of_service(h)),
                }
            )
        return out

    async def rpc_node_list(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """``node_list {cluster?}`` -> every node with health, lemon score and GPUs."""
        q = NodeListQuery.model_validate(body)
        clusters = [q.cluster] if q.cluster else await self.nodes.clusters()
        now = time.time()
        out = []
        for cluster in clusters:
            inv = await self.nodes.inventory(cluster)
            health = await self.nodes.health_all(cluster)
            for node in sorted(set(inv) | set(health)):
                out.append(
                    await self._node_view(
                        cluster, node, inv.get(node), health.get(node, NodeHealth.HEALTHY), now
                    )
                )
        return out

    async def _locate(self, q: NodeQuery) -> str:
        cluster = q.cluster or await self.nodes.find_cluster(q.node)
        if cluster is None or not await self.ctx.redis.hexists(
            self.nodes.nodes_key(cluster), q.node
        ):
            raise NotFound(
                f"node {q.node} is unknown to the detector (no telemetry from it"
                f"{' in cluster ' + q.cluster if q.cluster else ''})",
                "node",
            )
        return cluster

    async def rpc_node_get(self, body: dict[str, Any]) -> dict[str, Any]:
        """``node_get {node, cluster?}`` -> one node."""
        q = NodeQuery.model_validate(body)
        cluster = await self._locate(q)
        inv = (await self.nodes.inventory(cluster)).get(q.node)
        return await self._node_view(
            cluster, q.node, inv, await self.nodes.health(cluster, q.node), time.time()
        )

    async def rpc_node_return(self, body: dict[str, Any]) -> dict[str, Any]:
        """``node_return {node}``: back to healthy after quarantine, reset or drain.

        Open episodes of the node close, so a fault that recurs afterwards is a repeat
        (escalated to quarantine for hardware inspection).
        """
        q = NodeQuery.model_validate(body)
        cluster = await self._locate(q)
        previous = await self.nodes.health(cluster, q.node)
        closed = await self.episodes.close_node(self.nodes.episodes_key(cluster, q.node))
        await self.nodes.set_health(cluster, q.node, NodeHealth.HEALTHY)
        await self.nodes.clear_gpus(cluster, q.node)
        now = time.time()
        await self.bus.publish(
            NodeHealthChanged(
                event_id=make_event_id("return", cluster, q.node, int(now * 1000)),
                source=SERVICE,
                cluster=cluster,
                node=q.node,
                health=NodeHealth.HEALTHY,
                lemon_score=await self.nodes.lemon(cluster, q.node, now),
                reason=f"returned to service by operator (was {previous.value})",
            ),
            Subjects.NODE_HEALTH,
        )
        view = await self._node_view(
            cluster,
            q.node,
            (await self.nodes.inventory(cluster)).get(q.node),
            NodeHealth.HEALTHY,
            now,
        )
        return {**view, "previous_health": previous.value, "episodes_closed": closed}


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


__all__ = ["Detector", "DetectorSettings", "setup"]
