"""Liveness: the sweeps over the heartbeats of the jobs this replica owns.

Every ``detector_sweep_interval_s`` :meth:`LivenessMixin.sweep` runs the heartbeat rules of
``rules.py`` over each job: a member silent past the timeout is **worker_lost**
(``faults.py``), a live rank without step progress past the hang bound is **worker_hang**
(one per member and step, or one job-wide warning when every rank stalled at the same
step), and a rank whose step times are persistently slower than the others' is a
**straggler**.
"""

from __future__ import annotations

import asyncio
import time

from services.detector.faults import FaultsMixin
from services.detector.rules import (
    TAXONOMY,
    MemberProgress,
    hang_bound,
    hung_members,
    lost_members,
    straggler_ranks,
)
from services.detector.state import JOB_TTL_S, JobActivity
from torchrelay.contract import FaultAction, FaultKind, Severity, make_event_id

# How long after a member was lost, or the generation changed, stalls are not hangs.
HANG_GRACE_AFTER_DISRUPTION_S = 120.0


class LivenessMixin(FaultsMixin):
    """Heartbeat silence, hangs and stragglers."""

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
            for launcher, (node, seen) in list(act.launchers.items()):
                act.launchers[launcher] = (node, seen + seconds)

    async def sweep(self, now: float) -> None:
        """Run the heartbeat rules (lost, hang, straggler) over every job this replica owns."""
        for job_id, act in list(self.activity.items()):
            if now - act.last_beat > 300.0:
                del self.activity[job_id]
                continue
            for launcher, (node, seen) in list(act.launchers.items()):
                if now - seen > self.cfg.launcher_timeout_s:
                    del act.launchers[launcher]  # a later beat brings it back
                    await self._host_lost(job_id, launcher, node, now - seen)
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

    async def _host_lost(self, job_id: str, launcher: str, node: str, silent_s: float) -> None:
        """A host launcher went silent: every rank on its host is lost now, one
        worker_lost each, without waiting for the ranks' own heartbeats to time out."""
        if await self.jobs.finished(job_id) or await self.jobs.app_error(job_id):
            return
        got, cluster = await self.jobs.ranks_and_cluster(job_id)
        if got is None:
            return
        now = time.time()
        for a in got[1]:
            if a["node"] != node or await self.jobs.exited(job_id, a["member_id"]):
                continue
            await self._worker_lost(
                job_id,
                a["member_id"],
                int(a["rank"]),
                cluster,
                node,
                int(a["gpu"]),
                now,
                {
                    "signal": "launcher_lost",
                    "launcher": launcher,
                    "silent_s": round(silent_s, 3),
                    "timeout_s": self.cfg.launcher_timeout_s,
                    "generation": got[0],
                },
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
            await self.publish_fault(
                FaultKind.WORKER_HANG,
                make_event_id("worker_hang", job_id, "job", step),
                cluster=first.cluster,
                node=first.node,
                gpu=first.gpu,
                job_id=job_id,
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
                signal_at=now,
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
            await self.publish_fault(
                FaultKind.WORKER_HANG,
                make_event_id("worker_hang", job_id, m.member_id, m.step),
                cluster=m.cluster,
                node=m.node,
                gpu=m.gpu,
                job_id=job_id,
                rank=rank,
                member_id=m.member_id,
                evidence={
                    "signal": "no_step_progress",
                    "step": m.step,
                    "stalled_s": round(now - m.last_progress, 3),
                    "bound_s": round(bound, 3),
                    "follow_up": row.follow_up,
                },
                signal_at=now,
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
        await self.publish_fault(
            FaultKind.STRAGGLER,
            make_event_id("straggler", job_id, holder.member_id, number),
            cluster=holder.cluster,
            node=holder.node,
            gpu=holder.gpu,
            job_id=job_id,
            rank=rank,
            member_id=holder.member_id,
            repeat=number,
            evidence={"signal": "step_time", **evidence},
            signal_at=now,
        )
