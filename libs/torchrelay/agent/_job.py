"""The in-job agent: ``torchrelay.init()`` and :class:`Job` (docs/design.md §4).

One ``Job`` per training process. The training thread runs the user's loop; a background
thread (``_net.NetThread``) talks to NATS and delivers new generations. Steps commit only
when the live group's all-reduce completes; a collective in flight is abandoned the moment
a newer generation (mode ``immediate``) is known; a ``boundary`` generation is entered after
a step that every rank agrees on through a flag carried in that step's all-reduce.

This module is the public API; the parts it builds on each have a module: ``_member``
(identity and shared state), ``_hooks`` (reports, fencing, exits), ``_recovery``
(generations, groups, state sync) and ``_exchange`` (a step's collectives and commit).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchrelay.agent._data import StepBatchSampler, seed_step
from torchrelay.agent._errors import AgentError
from torchrelay.agent._exchange import GradientExchange
from torchrelay.agent._feed import make_feed
from torchrelay.agent._group import Abandoned, CollectiveError
from torchrelay.agent._mesh import MESH_GROUPS
from torchrelay.agent._state import Stateful, state_digest, warm_serialization
from torchrelay.contract import ReportKind, Role, make_event_id

log = logging.getLogger("torchrelay.agent")

LIVENESS_INTERVAL_S = 0.5


class Job(GradientExchange):
    """This process's membership in a torchrelay job (create it with :func:`init`)."""

    def __init__(
        self,
        *,
        collective_timeout_s: float | None = None,
        connect_timeout_s: float = 30.0,
        verify_every: int | None = None,
        overlap: bool | None = None,
        bucket_mb: float | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        checkpoint_keep: int | None = None,
        checkpoint_every_s: float | None = None,
    ) -> None:
        super().__init__(
            collective_timeout_s=collective_timeout_s,
            connect_timeout_s=connect_timeout_s,
            verify_every=verify_every,
            overlap=overlap,
            bucket_mb=bucket_mb,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            checkpoint_keep=checkpoint_keep,
            checkpoint_every_s=checkpoint_every_s,
        )
        self._install_exit_hooks()
        self._report(
            ReportKind.JOINED,
            store_addr=self.store_addr,
            generation=0,
            event_id=make_event_id("joined", self.member_id),
        )
        self._net.watch_generation(self.job_id, self._on_generation)
        self._net.start_every(LIVENESS_INTERVAL_S, self._liveness)
        warm_serialization()  # not on the first recovery's path

    # ------------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        """This process's rank in its current generation (or the one that named it)."""
        return self._current_rank()

    @property
    def world_size(self) -> int:
        """The job's number of ranks."""
        gen = self._gen or self._latest
        if gen is None:
            raise AgentError("the job has no generation yet")
        return gen.world_size

    @property
    def generation(self) -> int:
        """The generation this process trains in (0 before it holds a rank)."""
        return self._generation_number()

    @property
    def committed_step(self) -> int:
        """The last step committed on every live rank (-1 before the first)."""
        return self._committed

    @property
    def device(self) -> torch.device:
        """Where collectives run: the CUDA device under NCCL, else the CPU."""
        return self.backend.device

    # ------------------------------------------------------------------ public API

    def track(self, **stateful: Stateful) -> None:
        """Register objects whose state moves with the rank (model, optimizer, scheduler...).

        Every process of the job must track the same names.
        """
        for name, obj in stateful.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"job.track({name}=...) needs state_dict() and load_state_dict()")
            self._tracked[name] = obj

    def device_mesh(
        self, shape: int | tuple[int, ...], *, mesh_dim_names: tuple[str, ...] | None = None
    ) -> DeviceMesh:
        """A ``DeviceMesh`` over the job's ranks, for ``fully_shard`` (FSDP2, HSDP with a
        2-D mesh) and DTensor tensor parallelism; call it after :func:`init`, on every
        rank, instead of ``dist.init_process_group`` and ``init_device_mesh``.

        Its process groups (and ``torch.distributed``'s default group, which it sets up)
        are torchrelay's: each generation rebinds them to its own gloo/NCCL group, so the
        sharded model and its optimizer outlive a migration's regrouping. FSDP2 reduces the
        gradients itself; :meth:`reduce_gradients` then snapshots the rank's shard and the
        step commits at the next step boundary. A lost rank gets its shard from a rank that
        holds the same one (HSDP's replica, a TP shard's data-parallel peer); a shard no
        survivor holds stops the job with an error (docs/design.md §12).
        """
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"job.device_mesh needs positive whole dimensions, got {shape!r}")
        size = 1
        for d in dims:
            size *= d
        if size != self.world_size:
            raise ValueError(
                f"job.device_mesh{dims} spans {size} ranks but the job has {self.world_size}"
            )
        try:
            MESH_GROUPS.init_default(self.rank, self.world_size)
        except RuntimeError as exc:
            raise AgentError(str(exc)) from None
        MESH_GROUPS.watch(self._wakeup, self._mesh_stale)
        self._sharded = True
        mesh = init_device_mesh(self.device.type, dims, mesh_dim_names=mesh_dim_names)
        self._mesh = mesh
        if self._gen is not None and self._pg is not None:  # built after the group formed
            self._rebind_mesh(self._gen)
        return mesh

    def _mesh_stale(self) -> bool:
        """Whether the mesh's collectives must be left: a newer immediate generation."""
        gen = self._gen
        return self._exiting or (gen is not None and self._latest_immediate > gen.generation)

    def sampler(
        self, dataset: Any, batch_size: int, *, seed: int = 0, shuffle: bool = True
    ) -> StepBatchSampler:
        """A ``batch_sampler`` for ``DataLoader(dataset, batch_sampler=...)``: give the
        loader to :meth:`batches`, which moves the sampler to each step, so the loader's
        workers, ``pin_memory`` and prefetching serve the batch of (step, rank) whoever
        holds the rank."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive whole number, got {batch_size!r}")
        return StepBatchSampler(dataset, batch_size, seed=seed, shuffle=shuffle)

    def batches(
        self,
        dataset: Any,
        batch_size: int | None = None,
        max_steps: int | None = None,
        *,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        accumulate: int = 1,
    ) -> Iterator[tuple[int, Any]]:
        """Yield ``(step, batch)`` for this rank until ``max_steps`` steps are committed.

        ``dataset`` is a map-style dataset (batched here, ``batch_size`` per rank), a
        ``DataLoader`` built on :meth:`sampler`, or a loader with ``state_dict()`` such as
        torchdata's ``StatefulDataLoader`` (iterable and streaming datasets; its position
        moves with the rank). With ``accumulate=k`` each step yields an iterator of its
        ``k`` micro-batches instead of one batch: run forward and backward on each, then
        reduce once.

        The batch of (step, rank) and the step's RNG seeds are pure functions of the seed,
        the step and the rank, so whoever holds the rank sees the same data and dropout. A
        step that did not commit (a peer failed) is yielded again.
        """
        if not self._tracked:
            log.warning(
                "torchrelay: nothing is tracked; call job.track(model=..., "
                "optimizer=...) or a spare cannot receive the state"
            )
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0:
            raise ValueError(f"job.batches needs max_steps, a whole number >= 0, got {max_steps!r}")
        self._feed = feed = make_feed(
            dataset, batch_size, seed, shuffle, collate_fn, accumulate, self._tracked
        )
        self._load_checkpoint()
        while True:
            self._end_step()
            if self._regroup or self._pg is None:
                self._enter_generation()
            gen = self._gen
            assert gen is not None
            assert self._rank is not None
            if not self._checkpoint_if_due(gen):
                continue
            step = self._committed + 1
            if step >= max_steps:
                if self._agree_done(max_steps):
                    return
                continue
            self._undo_outside_changes()
            feed.prepare(step, max_steps, self._rank, gen.world_size)
            seed_step(feed.seed, step, self._rank)
            micro = feed.draw(step, self._rank)
            if feed.drawn is not None and not self._exchange_positions(gen, feed.drawn):
                continue
            self._in_step, self._step_called = step, False
            self._step_started = time.perf_counter()
            if accumulate == 1:
                batch = next(micro)
                self._arm_overlap(gen)
                yield step, batch
            else:
                yield step, self._micro_batches(micro, accumulate, gen)
            if not self._step_called:
                raise AgentError(
                    "call job.step(optimizer) or job.reduce_gradients(optimizer) once for "
                    "every step of job.batches()"
                )

    def step(self, *optimizers: torch.optim.Optimizer) -> bool:
        """All-reduce the gradients over the live group and step the optimizers.

        ``job.reduce_gradients(*optimizers)`` followed by each ``optimizer.step()``; use
        those two where something must run in between (clipping, a GradScaler).
        """
        if not self.reduce_gradients(*optimizers):
            return False
        for opt in optimizers:
            opt.step()
        self._end_step()
        return True

    def reduce_gradients(self, *optimizers: torch.optim.Optimizer) -> bool:
        """All-reduce the optimizers' gradients over the live group: True when the step
        committed, and every rank now holds the same mean gradients.

        Then, as under DDP, the loop steps the optimizers itself, after whatever needs the
        global gradient: ``clip_grad_norm_``, ``GradScaler.unscale_/step/update``, a
        gradient-norm log. On every rank the same bits go in, so the same bits come out.

        If a peer fails during the all-reduce, the step waits for the new generation and,
        when this rank keeps its rank in a group of the same size, repeats only the
        all-reduce with the gradients it already has (the rank's new holder computes the
        lost rank's share): the step still commits, nothing is recomputed here. Otherwise
        (the group shrank, the rank changed, or this rank received newer state) it returns
        False: the gradients are dropped, and ``job.batches`` yields the step again in the
        new generation; the loop must then not step its optimizers.
        """
        if self._feed is not None and self._step_called and self._in_step is None:
            raise AgentError(
                "job.reduce_gradients() (or job.step()) was already called for this step"
            )
        self._end_step()
        self._step_called = True
        if self._regroup or self._pg is None:
            self._enter_generation()
        step = self._in_step if self._in_step is not None else self._committed + 1
        params = [
            p
            for opt in optimizers
            for group in opt.param_groups
            for p in group["params"]
            if p.requires_grad
        ]
        params = list(dict.fromkeys(params))  # a parameter shared by two optimizers: once
        if self._sharded:
            return self._prepare_sharded(step, params)
        if self._pending is not None:
            gen = self._gen
            assert gen is not None
            try:
                self._settle_state()
            except Abandoned:
                self._discard(params)
                return False
            except CollectiveError as exc:
                self._collective_failed(gen, self.rank, exc)
                self._discard(params)
                return False
        if self._resume is not None:
            self._mark("allreduce", step=step)
        self._reducer.set_params(params)
        repeat = False
        while True:
            gen, pg = self._gen, self._pg
            assert gen is not None
            try:
                if repeat and self._feed is not None and self._feed.drawn is not None:
                    # The rank's new holder exchanges the positions before its all-reduce,
                    # as every rank did before this one's first try.
                    coll = self._collectives(pg, self.rank, self._stale(gen))
                    self._positions = coll.allgather_sized(self._feed.drawn)
                self._all_reduce(gen, pg, step)
                break
            except Abandoned:
                pass
            except CollectiveError as exc:
                self._collective_failed(gen, self.rank, exc)
            if not self._keeps_gradients(gen):
                self._discard(params)
                return False
            repeat = True
        if self._exiting:  # fenced meanwhile: never commit after that
            self._fence("a newer generation does not name this member")
        if self._resume is not None:
            self._mark("allreduced", step=step)
        switch = self._reducer.finish(gen.world_size)
        if self._feed is not None and self._feed.drawn is not None:
            self._feed.committed(step, self._positions)
        self._commit(step, gen)
        self._after = (gen, step, switch)
        return True

    def finish(self) -> None:
        """Report that this rank finished and close the connection (call once, at the end)."""
        if self._finished:
            return
        self._finished = True
        self._after = None
        self._wait_checkpoints()
        # Tells the launcher this member completed training, whatever its exit code.
        self._write_exit_record({"kind": "finished", "step": self._committed})
        self._report(
            ReportKind.FINISHED,
            generation=self.generation,
            rank=self._rank,
            step=self._committed,
            event_id=make_event_id("finished", self.member_id, self.generation),
        )
        if self._pg is not None:
            # A clean group tears down quickly, but never risk it on the training thread.
            self.backend.abandon(self._pg)
            self._pg = None
        self._net.close(5.0)

    def state_digest(self) -> str:
        """sha256 of the exact bits of every tracked state and the committed step."""
        return state_digest(self._tracked, self._committed)


def init(warm_up: Callable[[], object] | None = None, **kwargs: Any) -> Job:
    """Join the job this process was launched into; returns once a generation names it.

    A worker returns when the job's first generation is formed; a hot spare
    (``TORCHRELAY_ROLE=spare``) blocks here until a generation gives it a rank.

    Args:
        warm_up: called once by a hot spare, before it waits, to do what its first step
            would otherwise do cold while the survivors wait for it: typically one forward,
            backward and optimizer step on any batch, then ``zero_grad()`` (on a GPU: CUDA
            and cuBLAS/cuDNN set-up, autotuning, ``torch.compile``). It may change the
            tracked state freely: the spare receives the whole state from a survivor before
            its first step, and its gradients are dropped then. Workers never call it. If it
            raises, the spare logs why and serves without warm-up. The spare is registered
            (and may be chosen) while it warms up: a failure meanwhile waits for the warm-up
            to end, so keep it to about one step.

    Keyword Args:
        collective_timeout_s: how long a collective may hang before it counts as failed
            (default ``TORCHRELAY_COLLECTIVE_TIMEOUT_S`` or 60).
        connect_timeout_s: how long to retry the first NATS connection (default 30).
        overlap: all-reduce the gradients in buckets during backward, as DDP does
            (default ``TORCHRELAY_OVERLAP``, on); off: one all-reduce after backward.
        bucket_mb: the overlap's bucket size (default ``TORCHRELAY_BUCKET_MB`` or 25).
        verify_every: compare every rank's tracked state every N steps (0: never).
        checkpoint_dir: where to write asynchronous DCP checkpoints of the tracked state
            (default ``TORCHRELAY_CHECKPOINT_DIR``; none: no checkpoints); a job resumes
            from the newest complete one there, and the ``checkpoint_restart`` policy
            restarts the job from it (a shared file system for a job across hosts).
        checkpoint_every: steps between checkpoints (``TORCHRELAY_CHECKPOINT_EVERY``).
        checkpoint_every_s: seconds between checkpoints, on rank 0's clock
            (``TORCHRELAY_CHECKPOINT_EVERY_S``); with ``checkpoint_every`` too, whichever
            comes first. The ranks agree on it in one small all-reduce a step.
        checkpoint_keep: how many complete checkpoints to keep (default 2).
    """
    if warm_up is not None and not callable(warm_up):
        raise TypeError(f"torchrelay.init(warm_up=...) needs a callable, got {warm_up!r}")
    job = Job(**kwargs)
    if job.role == Role.SPARE:
        _warm_up()
        if warm_up is not None:
            job._run_warm_up(warm_up)
    job._named_generation()
    # torchrun's names for code that reads them after init(): a spare learns its rank here.
    os.environ["RANK"] = str(job.rank)
    os.environ["WORLD_SIZE"] = str(job.world_size)
    return job


def _warm_up() -> None:
    """Import what a training script's first optimizer pulls in, while a spare waits.

    Building the first torch optimizer imports ``torch._dynamo`` (seconds of CPU). A hot
    spare does it before it is needed, so the survivors do not wait for it after a failure.
    """
    try:
        import torch._dynamo  # noqa: F401
    except Exception as exc:
        log.debug("torchrelay: warm-up import failed: %r", exc)
