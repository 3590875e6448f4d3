"""What comes in on core NATS: telemetry (routine and critical) and heartbeats.

Each node (``tr.tel.<cluster>.<node>``) and each job (``tr.hb.<job>``) has one owning replica
(rendezvous hashing over the live replicas, ``state.Membership``): a message that is not
ours is handed to its owner on ``tr.int.detector.<replica>``; critical batches (XIDs) go as
a request on ``tr.int.detector-critical.<replica>`` and are evaluated here when the owner
does not answer. Ours are queued (critical first, routine bounded), decoded and evaluated by
the per-sample rules; findings go to ``hardware.py``, off the telemetry path. Heartbeats
update each member's liveness and step progress, which ``liveness.py`` sweeps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from pydantic import ValidationError

from services.detector.hardware import HardwareFaultsMixin
from services.detector.inventory import InventoryMixin
from services.detector.rules import GpuWindows, MemberProgress, evaluate_sample
from services.detector.state import JobActivity
from torchrelay.bus import validation_message
from torchrelay.contract import Heartbeat, Subjects, TelemetryBatch

# Internal subject on which a replica hands a batch to the replica that owns its node/job.
FORWARD_PREFIX = "tr.int.detector"
FORWARD_PREFIX_CRITICAL = "tr.int.detector-critical"
FORWARD_SUBJECT_HEADER = "Tr-Subject"
MAX_QUEUED_BATCHES = 50_000
_CRITICAL = b'"critical":true'
_CRITICAL_SPACED = b'"critical": true'


class IngestMixin(InventoryMixin, HardwareFaultsMixin):
    """Routing, the telemetry queue and worker, and the telemetry and heartbeat handlers."""

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
        if hb.kind == "launcher":
            act.launchers[hb.member_id] = (hb.node, now)
            return
        if hb.kind == "launcher_stopped":
            act.launchers.pop(hb.member_id, None)
            return
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
