"""Reports: the durable consumer ``detector-reports``.

The job directory (JobRegistered, GenerationChanged, JOINED spares, JobFinished) is kept in
Redis, so every replica names the job, rank and member holding a GPU slot. Agents' and
launchers' reports become faults: a WORKER_EXIT that lost a rank and a COLLECTIVE_FAILED
naming a peer are **worker_lost** (``faults.py``); an APPLICATION_ERROR (or an exit 1 with an
error) is **application_error**. Exits of fenced or spare members, and the launcher's kills
after an application error or after the job finished, are not faults.
"""

from __future__ import annotations

import time
from typing import Any

from services.detector.faults import FaultsMixin
from services.detector.state import JOB_TTL_S
from torchrelay.bus import Delivery
from torchrelay.contract import (
    AgentReport,
    Event,
    FaultKind,
    GenerationChanged,
    JobFinished,
    JobRegistered,
    JobRestarted,
    ReportKind,
    make_event_id,
)


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


class ReportsMixin(FaultsMixin):
    """The job directory and the faults that reports tell of."""

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
        elif isinstance(event, JobRestarted):
            # The launcher replaced every process (checkpoint_restart): the old members'
            # silence is no fault, and the job stalls while the new ones start.
            got = await self.jobs.ranks(event.job_id)
            new = {m.member_id for m in event.members}
            for a in got[1] if got else []:
                if a["member_id"] not in new:
                    await self.jobs.mark_exited(event.job_id, str(a["member_id"]))
            self.activity.pop(event.job_id, None)
            self.recent_change[event.job_id] = time.time()
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
        rank = r.rank if r.rank is not None else await self.jobs.rank_of(r.job_id, r.member_id)
        await self.publish_fault(
            FaultKind.APPLICATION_ERROR,
            make_event_id("application_error", r.job_id, r.member_id),
            cluster=r.cluster,
            node=r.node,
            gpu=r.gpu,
            job_id=r.job_id,
            rank=rank,
            member_id=r.member_id,
            evidence={
                "signal": r.kind.value,
                "exit_code": r.exit_code,
                "error": (r.error or "")[:2000],
            },
            signal_at=at,
        )
