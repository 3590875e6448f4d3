"""``checkpoint_restart`` that restarts: the launcher replaces every process of its job by a
new one on the slots the job has, resuming from the newest complete checkpoint
(docs/design.md §13)."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from torchrelay.bus import BusError
from torchrelay.checkpoints import usable_checkpoint
from torchrelay.contract import (
    FaultKind,
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

Slot = tuple[str, int]  # (node, gpu)
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


def restart_slots(opts: Options, current: Generation | None) -> list[Slot]:
    """The slots the newest generation's ranks hold (the job's own before it formed)."""
    if current is None:
        return [slot_of(i, opts.nodes, opts.cluster) for i in range(opts.nproc)]
    return [(a.node, a.gpu) for a in sorted(current.ranks, key=lambda a: a.rank)]


class RestartError(Exception):
    """The job cannot be restarted on the slots it has (the message says why)."""


# Faults of the process, not of its GPU: the slot can run the restarted rank.
PROCESS_FAULTS = frozenset(
    {FaultKind.WORKER_LOST, FaultKind.WORKER_HANG, FaultKind.APPLICATION_ERROR}
)


def unfit_slot(failed: MigrationFailed) -> tuple[str, int | None] | None:
    """The slot a failure leaves unfit for a restarted rank: its GPU after a GPU fault, the
    whole node when it is drained, none after a fault of the process (or when the executor
    did not say where the rank was)."""
    if failed.node is None or failed.fault_kind is None or failed.fault_kind in PROCESS_FAULTS:
        return None
    if failed.fault_kind == FaultKind.PLANNED_DRAIN:
        return (failed.node, None)
    return (failed.node, failed.gpu)


@dataclass(frozen=True)
class RestartPlan:
    """Where a restart runs: ``slots`` in rank order; ``left_out`` the job's slots it does
    not use (failed, or beyond the world size it shrinks to)."""

    slots: list[Slot]
    left_out: list[Slot]
    world_before: int


def plan_restart(
    slots: list[Slot], unfit: Iterable[tuple[str, int | None]], nproc: int, allow_shrink: bool
) -> RestartPlan:
    """The restart's slots: the job's slots but the unfit ones, all of them for the same
    world size; with ``allow_shrink`` and fewer fit slots than ranks, the largest world
    size that divides the job's ``nproc`` (a mesh of 4 ranks shrinks to 2, its batch splits
    evenly) and fits (docs/design.md §13).

    Raises:
        RestartError: too few fit slots for the world size, and shrinking is not allowed
            (or no slot is fit at all).
    """
    bad = set(unfit)
    fit = [s for s in slots if s not in bad and (s[0], None) not in bad]
    gone = [s for s in slots if s not in fit]
    if not gone:
        return RestartPlan(slots=list(slots), left_out=[], world_before=len(slots))
    named = ", ".join(f"GPU {gpu} of node {node}" for node, gpu in gone)
    if not fit:
        raise RestartError(f"no slot of the job is fit to restart on ({named} failed)")
    if not allow_shrink:
        raise RestartError(
            f"a restart needs {len(slots)} slots and {len(fit)} are fit ({named} failed); "
            "--allow-shrink lets it restart at fewer ranks"
        )
    size = max(d for d in range(1, len(fit) + 1) if nproc % d == 0)
    return RestartPlan(slots=fit[:size], left_out=gone + fit[size:], world_before=len(slots))


class Restarts:
    """One launcher's checkpoint restarts: how many so far and the one under way."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.count = 0
        self._task: asyncio.Task[None] | None = None
        # When the last restart began: a fallback decided before it is about processes
        # that restart already replaced.
        self._at: datetime | None = None
        self._unfit: set[tuple[str, int | None]] = set()  # slots whose GPU failed

    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def note(self, failed: MigrationFailed) -> None:
        """Remember the slot a failure leaves unfit, whether or not it starts a restart."""
        slot = unfit_slot(failed)
        if slot is not None:
            self._unfit.add(slot)

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

    def plan(self, current: Generation | None) -> RestartPlan:
        """Where the restart would run now.

        Raises:
            RestartError: it cannot (too few fit slots, see :func:`plan_restart`).
        """
        o = self.opts
        return plan_restart(restart_slots(o, current), self._unfit, o.nproc, o.allow_shrink)

    async def take(self, launcher: Launcher, failed: MigrationFailed) -> str | None:
        """Restart the job for ``failed``; why it cannot (None: the restart started)."""
        problem = self.problem()
        if problem is not None:
            return problem
        try:
            plan = self.plan(launcher._last_gen or await launcher._generation())
        except RestartError as exc:
            return str(exc)
        self.start(launcher, failed, plan)
        return None

    def start(self, launcher: Launcher, failed: MigrationFailed, plan: RestartPlan) -> None:
        self.count += 1
        self._at = utcnow()
        self._task = asyncio.create_task(self._run(launcher, failed, plan))

    async def _run(self, launcher: Launcher, failed: MigrationFailed, plan: RestartPlan) -> None:
        o = self.opts
        assert o.checkpoint_dir is not None
        # SIGTERM first: each agent writes the step it had committed (the steps lost).
        await launcher._stop_all(grace_s=STOP_GRACE_S, sig=signal.SIGTERM)
        committed = committed_steps(launcher)
        found = usable_checkpoint(o.checkpoint_dir)
        steps = found.steps if found is not None else 0
        launcher.children = {}
        launcher._world_size = len(plan.slots)
        for i, (node, gpu) in enumerate(plan.slots):
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
            world_size=len(plan.slots),
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
        at = "" if not plan.left_out else f" at {len(plan.slots)} ranks (was {plan.world_before})"
        print(
            f"torchrelay run: restart {self.count}/{o.max_restarts} of job {o.job_id}{at} "
            f"from {found.path if found else 'step 0 (no complete checkpoint)'}: "
            f"{steps} steps kept, {'?' if lost is None else lost} lost",
            file=sys.stderr,
            flush=True,
        )
        launcher._changed.set()
