"""The one place a ``FaultDetected`` is built and published, and ``worker_lost``.

Every fault site (a GPU finding in ``hardware.py``; worker_hang and straggler in
``liveness.py``; application_error in ``reports.py``; worker_lost here, opened from both
liveness and reports) decides *whether* an episode is new and *what* it found, then calls
:meth:`FaultsMixin.publish_fault` with the few things that vary. The event id is the fault id:
the publish's ``Nats-Msg-Id``, so a double detection during a hand-over between replicas is
dropped by JetStream's dedupe.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from services.detector.core import SERVICE, DetectorCore
from services.detector.rules import TAXONOMY
from services.detector.state import JOB_TTL_S
from torchrelay.contract import (
    FaultAction,
    FaultDetected,
    FaultKind,
    Severity,
    Subjects,
    make_event_id,
)


class FaultsMixin(DetectorCore):
    """Builds and publishes faults; opens a member's one worker_lost episode."""

    async def publish_fault(
        self,
        kind: FaultKind,
        fault_id: str,
        *,
        cluster: str,
        node: str,
        gpu: int | None,
        evidence: dict[str, Any],
        signal_at: float,
        job_id: str | None = None,
        rank: int | None = None,
        member_id: str | None = None,
        severity: Severity | None = None,
        action: FaultAction | None = None,
        repeat: int = 1,
        first_seen_at: float | None = None,
    ) -> FaultDetected:
        """Build the episode's ``FaultDetected`` and publish it on ``tr.evt.fault.detected``.

        ``event_id`` = ``fault_id`` (the caller's ``make_event_id``: the dedupe key).
        ``severity`` and ``action`` are the taxonomy row's unless given (the GPU rules'
        ``decide``, a job-wide stall). ``first_seen_at`` (epoch seconds) defaults to now, as
        the model does. ``signal_at`` (when the signal was seen) feeds the latency histogram.
        """
        row = TAXONOMY[kind]
        # Passed only when given: otherwise the model's own default (now) applies.
        seen: dict[str, Any] = {}
        if first_seen_at is not None:
            seen["first_seen_at"] = datetime.fromtimestamp(first_seen_at, UTC)
        fault = FaultDetected(
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
            severity=row.severity if severity is None else severity,
            action=row.action if action is None else action,
            evidence=evidence,
            repeat=repeat,
            **seen,
        )
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
        return fault

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
        if related is not None:
            evidence = {
                **evidence,
                "related_fault_id": related[0],
                "related_fault_kind": related[1],
            }
        await self.publish_fault(
            FaultKind.WORKER_LOST,
            make_event_id("worker_lost", job_id, member_id),
            cluster=cluster,
            node=node,
            gpu=gpu,
            job_id=job_id,
            rank=rank,
            member_id=member_id,
            evidence=evidence,
            first_seen_at=at,
            signal_at=at,
        )
