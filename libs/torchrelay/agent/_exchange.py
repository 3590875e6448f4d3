"""A step's exchanges over the live group: loader positions, the gradients' all-reduce in
buckets, the commit, the divergence guard and what a step that did not commit undoes."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from torchrelay.agent._agree import find_divergence
from torchrelay.agent._buddy import WardCopy, alone, exchange_copies
from torchrelay.agent._checkpoint import CheckpointWrite, newest_loadable, stage
from torchrelay.agent._errors import AgentError, DivergenceError
from torchrelay.agent._group import GRAVEYARD, Abandoned, CollectiveError
from torchrelay.agent._mesh import MESH_GROUPS
from torchrelay.agent._recovery import Recovery
from torchrelay.agent._state import (
    outside_state,
    restore_outside_state,
    restore_snapshot,
    take_snapshot,
)
from torchrelay.contract import Generation, ReportKind, make_event_id

log = logging.getLogger("torchrelay.agent")

HEARTBEAT_MIN_INTERVAL_S = 0.2  # step heartbeats: at most 5 per second


class GradientExchange(Recovery):
    """The collectives of a step, from its batches to its commit."""

    def _micro_batches(self, micro: Iterator[Any], count: int, gen: Generation) -> Iterator[Any]:
        """The step's micro-batches; the last one's backward launches the overlap buckets."""
        for index, batch in enumerate(micro):
            if index == count - 1:
                self._arm_overlap(gen)
            yield batch

    def _arm_overlap(self, gen: Generation) -> None:
        stale = self._stale(gen)
        pg = self._pg
        self._reducer.arm(pg, lambda: self._pending is None and not stale())

    def _exchange_positions(self, gen: Generation, mine: bytes) -> bool:
        """Every rank's loader position after the step's batches (stateful feeds);
        False when the group failed or was left (the step is drawn again)."""
        assert self._rank is not None
        try:
            self._settle_state()
            coll = self._collectives(self._pg, self._rank, self._stale(gen))
            self._positions = coll.allgather_sized(mine)
        except Abandoned:
            return False
        except CollectiveError as exc:
            self._collective_failed(gen, self._current_rank(), exc)
            return False
        return True

    def _agree_done(self, max_steps: int) -> bool:
        """Every live rank has committed the last step: the loop may end everywhere."""
        gen, pg = self._gen, self._pg
        assert gen is not None
        flag = torch.tensor([self._committed], dtype=torch.int64, device=self.backend.device)
        try:
            self._settle_state()
            self._run(pg.allreduce([flag], dist.AllreduceOptions()), pg, self._stale(gen))
        except Abandoned:
            return False
        except CollectiveError as exc:
            self._collective_failed(gen, self._current_rank(), exc)
            return False
        done = int(flag.item()) >= gen.world_size * (max_steps - 1)
        if done and self.verify_every and not self._verify(gen, pg):
            return False  # the check was cut short by a new generation: agree again there
        return done

    def _all_reduce(self, gen: Generation, pg: Any, step: int) -> None:
        """Launch what the backward did not and wait for every bucket of the step.

        Raises:
            Abandoned, CollectiveError: the group was left or failed (it is given up).
        """
        with self._lock:
            switch_wanted = self._latest is not None and self._latest.generation > gen.generation
        works: list[Any] = []
        try:
            try:
                works = self._reducer.launch(pg, 1.0 if switch_wanted else 0.0)
            except AgentError:
                raise
            except RuntimeError as exc:  # the group refused a collective: it is broken
                raise CollectiveError(f"all-reduce could not start: {exc}") from exc
            self._chaos.hit("allreduce", step)
            for work in works:
                self._run(work, pg, self._stale(gen))
        except (Abandoned, CollectiveError):
            # The other buckets' collectives may still write into their buffers.
            GRAVEYARD.keep(*works, *self._reducer.forget(), in_flight=bool(works))
            if pg is self._pg:
                self.backend.abandon(pg)
                self._pg = None
            self._regroup = True
            raise

    def _end_step(self) -> None:
        """After the loop's optimizer step: a sharded step's commit, the divergence guard,
        a boundary switch."""
        self._commit_sharded()
        after, self._after = self._after, None
        if after is None:
            return
        gen, step, switch = after
        if self.verify_every and (step + 1) % self.verify_every == 0 and self._pg is not None:
            self._verify(gen, self._pg)
        if switch:
            self._switch_at_boundary(gen)

    def _prepare_sharded(self, step: int, params: list[torch.nn.Parameter]) -> bool:
        """A sharded step's ``reduce_gradients``: FSDP2 reduced the gradients over the mesh's
        groups. Unless one of this generation's collectives was poisoned, copy the state
        the step starts from and let the loop run its optimizer step; the step commits at
        the next step boundary (:meth:`_commit_sharded`), because the optimizer step itself
        runs collectives (``clip_grad_norm_``'s all-reduce) a fault can poison."""
        gen = self._gen
        assert gen is not None
        poisoned = MESH_GROUPS.poisoned
        if poisoned is not None:
            self._regroup = True
            if isinstance(poisoned, CollectiveError):
                self._collective_failed(gen, self._current_rank(), poisoned)
            self._discard(params)
            return False
        self._snapshot = take_snapshot(self._tracked, self._snapshot)
        self._uncommitted = (gen, step, params)
        self._chaos.hit("optimizer", step)
        return True

    def _commit_sharded(self) -> None:
        """After a sharded step's optimizer step: one agreement over the job's group, which
        carries every rank's poison and a boundary switch (as the buckets do). The step
        commits everywhere when no rank saw a poisoned collective; otherwise every rank puts
        its snapshot back and the step is yielded again (docs/design.md §12)."""
        pending, self._uncommitted = self._uncommitted, None
        if pending is None:
            return
        gen, step, params = pending
        pg, rank = self._pg, self._current_rank()
        poisoned = MESH_GROUPS.poisoned
        self._chaos.hit("commit", step)
        with self._lock:
            wanted = self._latest is not None and self._latest.generation > gen.generation
        vote = torch.tensor(
            [1.0 if wanted else 0.0, 1.0 if poisoned is not None else 0.0],
            device=self.backend.device,
        )
        failed: BaseException | None = poisoned
        peer_failed = False
        copy: WardCopy | None = None
        try:
            if pg is None:
                raise Abandoned
            copy = self._copy_to_buddy(gen, pg, rank, step)
            self._run(pg.allreduce([vote], dist.AllreduceOptions()), pg, self._stale(gen))
            peer_failed = vote[1].item() > 0
        except (Abandoned, CollectiveError) as exc:
            failed = failed or exc
        if failed is not None or peer_failed:
            self._ward_spare = copy  # of a step that did not commit: only its buffers
            snap, self._snapshot = self._snapshot, None  # the optimizer may now hold it
            assert snap is not None
            restore_snapshot(snap, self._tracked, self._mesh)
            self._regroup = True
            self._discard(params)
            self._rollback = None  # the snapshot put back what the loop changed too
            if isinstance(failed, CollectiveError):
                self._collective_failed(gen, rank, failed)
            else:  # left for a newer generation, or a peer's collective failed: one comes
                self._wait_past(gen)
            return
        if self._exiting:
            self._fence("a newer generation does not name this member")
        self._ward_spare, self._ward = self._ward, copy
        self._commit(step, gen)
        self._after = (gen, step, bool(vote[0].item() > 0))

    def _copy_to_buddy(self, gen: Generation, pg: Any, rank: int, step: int) -> WardCopy | None:
        """Pure FSDP's buddy copies at a boundary (:mod:`._buddy`); the ward's copy.

        Raises:
            Abandoned, CollectiveError: the group was left or failed (the receive buffers
                are given up: an abandoned receive may still write into them).
        """
        coll = self._collectives(pg, rank, self._stale(gen))
        classes = self._known_classes(coll)
        if not self.buddy_copies or not any(alone(classes)):
            return None
        reuse, self._ward_spare = self._ward_spare, None
        try:
            return exchange_copies(coll, classes, self._tracked, step, reuse)
        except (Abandoned, CollectiveError):
            if reuse is not None:
                GRAVEYARD.keep(*reuse.large)
            raise

    def _keeps_gradients(self, old: Generation) -> bool:
        """Enter the next generation from inside a step; True if this step's gradients hold.

        The gradient of (step, rank) is a pure function of the state at the last commit, the
        step and the rank (``job.batches`` and the per-step seeds). So a survivor that keeps
        its rank in a group of the same size, and whose state the new generation's sync did
        not replace, only has to redo the all-reduce; the rank's new holder computes the lost
        rank's gradient from the state it received. Nothing is recomputed on the survivors,
        and the all-reduce sums the same gradients in the same order as without the failure.
        """
        rank, committed = self._rank, self._committed
        self._enter_generation()
        new = self._gen
        assert new is not None
        # Before the first commit the start rule may replace a survivor's state without
        # moving its step: any state received means the gradients in hand are stale.
        received = bool(self._resume and self._resume.get("bytes_received"))
        return (
            new.world_size == old.world_size
            and self._rank == rank
            and self._committed == committed
            and not received
        )

    def _discard(self, params: list[torch.nn.Parameter]) -> None:
        GRAVEYARD.keep(*self._reducer.forget())
        self._lost_steps = 1
        for p in params:
            p.grad = None
        self._remember_outside_state()

    def _remember_outside_state(self) -> None:
        """A step did not commit: keep what the loop may still change behind the agent's
        back (a scheduler stepped whatever ``job.step()`` returned) to put it back before
        the step is yielded again, so the repeated step starts from the state it would have
        had (:func:`outside_state`)."""
        self._rollback = outside_state(self._tracked)

    def _undo_outside_changes(self) -> None:
        """Put back what :meth:`_remember_outside_state` kept (once)."""
        rollback, self._rollback = self._rollback, None
        if rollback is not None:
            restore_outside_state(self._tracked, rollback)

    def _verify(self, gen: Generation, pg: Any) -> bool:
        """The divergence guard: every rank digests its tracked state; any difference stops
        the job naming the first rank that differs from rank 0 (in a sharded job: from the
        first rank holding the same shard) and the first entry.

        Returns False when a collective failed or was left for a newer generation: the
        check is skipped (the next generation's sync starts every rank from one state).

        Raises:
            DivergenceError: two ranks hold different states.
        """
        rank = self._rank
        assert rank is not None
        try:
            coll = self._collectives(pg, rank, self._stale(gen))
            classes = self._known_classes(coll) if self._sharded else None
            found = find_divergence(coll, self._tracked, self._committed, classes)
        except Abandoned:
            return False
        except CollectiveError as exc:
            self._collective_failed(gen, rank, exc)
            return False
        if found is None:
            return True
        same = ", which holds the same shard" if self._sharded else ""
        raise DivergenceError(
            f"torchrelay divergence guard: after step {self._committed} in generation "
            f"{gen.generation} rank {found.ranks[0]}'s tracked state differs from rank "
            f"{found.reference}'s{same}, first in {found.path} (ranks that differ: "
            f"{found.ranks}); the job is stopped because its ranks no longer train one model"
        )

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_if_due(self, gen: Generation) -> bool:
        """Write the committed step's checkpoint if it ends an interval not yet considered;
        False when a collective failed and the generation must be left."""
        settings, steps = self.checkpoints, self._committed + 1
        if settings is None or steps <= self._checkpoint_last:
            return True
        due: bool | None = settings.every is not None and steps % settings.every == 0
        if not due and settings.every_s is not None:
            due = self._agree_time_due(gen, settings.every_s)
            if due is None:
                return False
        return not due or self._write_checkpoint(gen)

    def _agree_time_due(self, gen: Generation, every_s: float) -> bool | None:
        """Whether rank 0's clock says a checkpoint is due: one int64 all-reduced, so every
        rank takes it at the same step (None: the collective failed)."""
        pg, rank = self._pg, self._current_rank()
        late = rank == 0 and time.monotonic() - self._checkpoint_clock >= every_s
        vote = torch.tensor([1 if late else 0], dtype=torch.int64, device=self.backend.device)
        try:
            self._run(pg.allreduce([vote], dist.AllreduceOptions()), pg, self._stale(gen))
        except Abandoned:
            return None
        except CollectiveError as exc:
            self._collective_failed(gen, rank, exc)
            return None
        return bool(vote.item() > 0)

    def _write_checkpoint(self, gen: Generation) -> bool:
        """Start this rank's part of the checkpoint of the committed step (docs/design.md
        §13); False when the plans' exchange failed and the generation must be left."""
        settings = self.checkpoints
        assert settings is not None
        steps = self._committed + 1
        self._checkpoint_last = steps
        self._checkpoint_clock = time.monotonic()
        rank = self._current_rank()
        staged = stage(self._tracked, steps)
        write = CheckpointWrite(
            settings.directory, staged, rank, gen.world_size, settings, f"g{gen.generation}"
        )
        try:
            coll = self._collectives(self._pg, rank, self._stale(gen))
            plans = coll.allgather_sized(write.local_plan())
        except Abandoned:
            return False
        except CollectiveError as exc:
            self._collective_failed(gen, rank, exc)
            return False
        self._chaos.hit("checkpoint", steps)
        write.start(plans, lambda: self._exiting)
        self._checkpoint_writes = [w for w in self._checkpoint_writes if not w.done.is_set()]
        self._checkpoint_writes.append(write)
        self._mark("checkpoint_started", steps=steps)
        return True

    def _load_checkpoint(self) -> None:
        """A worker starting with its own state resumes from the newest complete checkpoint."""
        settings = self.checkpoints
        if settings is None or self._checkpoint_loaded or not self._has_state:
            return
        self._checkpoint_loaded = True
        if self._committed >= 0:
            return
        found, steps = newest_loadable(settings.directory, self._tracked)
        if found is None:
            return
        self._committed = steps - 1
        self._checkpoint_last = steps
        self._drop_gradients()
        self._mark("checkpoint_loaded", steps=steps)
        log.warning("torchrelay: %s resumes from %s (%d steps)", self.member_id, found.path, steps)
        gen = self._gen or self._latest
        world = found.world_size if gen is None else gen.world_size
        if found.world_size != world and self._current_rank() == 0:
            what = f"the job restarted at {world} ranks from a checkpoint of {found.world_size}"
            self._say_shrunk(found.world_size, world, what)

    def _wait_checkpoints(self, timeout_s: float = 120.0) -> None:
        """At the end: the checkpoints in flight get written (the last one included)."""
        deadline = time.monotonic() + timeout_s
        for write in self._checkpoint_writes:
            if not write.wait(max(0.0, deadline - time.monotonic())):
                log.warning("torchrelay: checkpoint %s was not completed", write.path)
        self._checkpoint_writes = []

    def _commit(self, step: int, gen: Generation) -> None:
        now = time.monotonic()
        self._committed = step
        self._in_step = None
        if self._step_started is not None:
            self._step_time = time.perf_counter() - self._step_started
        if self._resume is not None:
            resume, self._resume = self._resume, None
            since = self._last_commit_t if self._last_commit_t is not None else self._named_t
            stall_ms = 0.0 if gen.generation == 1 or since is None else (now - since) * 1000
            self._report(
                ReportKind.RESUMED,
                generation=resume["generation"],
                rank=resume["rank"],
                step=resume["step"],
                lost_steps=resume["lost_steps"],
                bytes_received=resume["bytes_received"],
                stall_ms=stall_ms,
                event_id=make_event_id("resumed", self.member_id, resume["generation"]),
            )
            self._mark("resumed", generation=resume["generation"], step=step, stall_ms=stall_ms)
            self._lost_steps = 0
            with self._lock:
                self._disrupted_t = None
        self._last_commit_t = now
        if now - self._last_step_hb >= HEARTBEAT_MIN_INTERVAL_S:
            self._last_step_hb = now
            self._heartbeat("step")
