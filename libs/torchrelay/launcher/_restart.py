"""``checkpoint_restart`` that restarts: the launcher replaces every process of its job by a
new one on the slots the job has, resuming from the newest complete checkpoint
(docs/design.md §13)."""

from __future__ import annotations

import asyncio
import signal
import sys
from datetime import datetime
from typing import TYPE_CHECKING

from torchrelay.bus import BusError
from torchrelay.checkpoints import usable_checkpoint
from torchrelay.contract import (
    Generation,
    JobRestarted,
    Member,
    MigrationFailed,
    Role,
    Subjects,
    make_event_id,
    utcnow,
)
from torchrelay.launcher._setup import Child, Options, slot_of

if TYPE_CHECKING:
    from torchrelay.launcher._launcher import Launcher

STOP_GRACE_S = 2.0  # SIGTERM to SIGKILL: well inside the detector's heartbeat timeout (5 s)


def committed_steps(launcher: Launcher) -> int | None:
    """The steps the job had committed when it failed: each agent stopped by SIGTERM wrote
    its committed step in its exit record (None: none did, e.g. a script's own handler)."""
    steps = []
    for child in launcher.children.values():
        record = launcher._exit_record(child.member_id)
        if record is not None and isinstance(record.get("committed_step"), int):
            steps.append(int(record["committed_step"]) + 1)
    return max(steps) if steps else None


def restart_slots(opts: Options, current: Generation | None) -> list[tuple[str, int]]:
    """Where the restarted ranks run: the slots the newest generation's ranks hold."""
    if current is None:
        return [slot_of(i, opts.nodes, opts.cluster) for i in range(opts.nproc)]
    return [(a.node, a.gpu) for a in sorted(current.ranks, key=lambda a: a.rank)]


class Restarts:
    """One launcher's checkpoint restarts: how many so far and the one under way."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.count = 0
        self._task: asyncio.Task[None] | None = None
        # When the last restart began: a fallback decided before it is about processes
        # that restart already replaced.
        self._at: datetime | None = None

    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def covers(self, failed: MigrationFailed) -> bool:
        """Whether a restart under way, or done after the fallback was decided, takes care
        of ``failed``."""
        return self.busy() or (self._at is not None and failed.occurred_at <= self._at)

    def problem(self) -> str | None:
        """Why this launcher cannot restart the job from its checkpoint (None: it can)."""
        o = self.opts
        if o.checkpoint_dir is None:
            return "the job has no --checkpoint-dir to restart from"
        if o.host is not None:
            return "restarting a job across hosts is not supported yet"
        if self.count >= o.max_restarts:
            return f"it was restarted {self.count} times already (--max-restarts)"
        return None

    def start(self, launcher: Launcher, failed: MigrationFailed) -> None:
        self.count += 1
        self._at = utcnow()
        self._task = asyncio.create_task(self._run(launcher, failed))

    async def _run(self, launcher: Launcher, failed: MigrationFailed) -> None:
        o = self.opts
        assert o.checkpoint_dir is not None
        current = launcher._last_gen or await launcher._generation()
        # SIGTERM first: each agent writes the step it had committed (the steps lost).
        await launcher._stop_all(grace_s=STOP_GRACE_S, sig=signal.SIGTERM)
        committed = committed_steps(launcher)
        slots = restart_slots(o, current)
        found = usable_checkpoint(o.checkpoint_dir)
        steps = found.steps if found is not None else 0
        launcher.children = {}
        for i, (node, gpu) in enumerate(slots):
            member = f"{o.job_id}-r{self.count}-w{i}"
            await launcher._spawn(Child(member, Role.WORKER, node, gpu, local_rank=i, rank=i))
        launcher._write_launcher_file()
        lost = None if committed is None else max(0, committed - steps)
        event = JobRestarted(
            event_id=make_event_id("job_restarted", o.job_id, self.count),
            source=launcher.launcher_id,
            job_id=o.job_id,
            tenant=o.tenant,
            restart=self.count,
            incident_id=failed.incident_id,
            migration_id=failed.migration_id,
            world_size=len(slots),
            members=[
                Member(member_id=c.member_id, role=c.role, node=c.node, gpu=c.gpu, pid=c.pid)
                for c in launcher.children.values()
            ],
            checkpoint=None if found is None else str(found.path),
            checkpoint_steps=steps,
            committed_steps=committed,
            lost_steps=lost,
        )
        try:
            await launcher.bus.publish(event, Subjects.JOB_RESTARTED, retry_for=10.0)
        except BusError as exc:
            launcher._gave_up = f"the checkpoint restart could not be announced: {exc}"
        print(
            f"torchrelay run: restart {self.count}/{o.max_restarts} of job {o.job_id} "
            f"from {found.path if found else 'step 0 (no complete checkpoint)'}: "
            f"{steps} steps kept, {'?' if lost is None else lost} lost",
            file=sys.stderr,
            flush=True,
        )
        launcher._changed.set()
