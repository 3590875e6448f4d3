"""GPU findings become faults: one ``FaultDetected`` per episode, and the node's health.

The rules (``rules.evaluate_sample``) run on the telemetry path in ``ingest.py``; what they find
comes here, off that path: the episode is opened in Redis (one fault per episode, whichever
replica fires), the fault names the job, rank and member holding the slot, and a hardware
fault adds to the node's lemon score and raises its health through the circuit breaker
(``NodeHealthChanged``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from services.detector.core import SERVICE
from services.detector.faults import FaultsMixin
from services.detector.rules import TAXONOMY, decide, lemon_weight
from services.detector.state import SlotHolder
from torchrelay.contract import (
    FaultKind,
    NodeHealth,
    NodeHealthChanged,
    Severity,
    Subjects,
    TelemetrySample,
    make_event_id,
)


class HardwareFaultsMixin(FaultsMixin):
    """A GPU's findings: episode, fault, lemon score, circuit breaker."""

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
        await self.publish_fault(
            kind,
            fault_id,
            cluster=s.cluster,
            node=s.node,
            gpu=s.gpu,
            job_id=holder.job_id if holder else None,
            rank=holder.rank if holder else None,
            member_id=holder.member_id if holder else None,
            severity=d.severity,
            action=d.action,
            evidence=ev,
            repeat=number,
            first_seen_at=first,
            signal_at=at,
        )
        if holder is not None and holder.member_id is not None and d.severity != Severity.INFO:
            await self.jobs.note_slot_fault(s.cluster, s.node, s.gpu, fault_id, kind.value)
        if TAXONOMY[kind].hardware:
            await self._node_effects(
                s.cluster, s.node, s.gpu, kind, d.severity, d.node_health, fault_id
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
