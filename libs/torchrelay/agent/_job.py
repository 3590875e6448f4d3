"""The in-job agent: ``torchrelay.init()`` and :class:`Job` (docs/design.md §4).

One ``Job`` per training process. The training thread runs the user's loop; a background
thread (``_net.NetThread``) talks to NATS and delivers new generations. Steps commit only
when the live group's all-reduce completes; a collective in flight is abandoned the moment
a newer generation (mode ``immediate``) is known; a ``boundary`` generation is entered after
a step that every rank agrees on through a flag carried in that step's all-reduce.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from torchrelay import deathlatch
from torchrelay.agent._agree import (
    NO_STATE,
    Collectives,
    find_divergence,
    start_sources,
    state_sources,
)
from torchrelay.agent._chaos import ENV as CHAOS_ENV
from torchrelay.agent._chaos import ChaosPoint
from torchrelay.agent._data import StepBatchSampler, seed_step
from torchrelay.agent._errors import AgentError, DivergenceError
from torchrelay.agent._feed import (
    POSITIONS,
    DataPositions,
    Feed,
    LoaderFeed,
    MapFeed,
    StatefulFeed,
)
from torchrelay.agent._group import (
    GRAVEYARD,
    Abandoned,
    Backend,
    CollectiveError,
    Wakeup,
    form_group,
    wait_work,
)
from torchrelay.agent._net import NetThread
from torchrelay.agent._reducer import DEFAULT_BUCKET_MB, Reducer
from torchrelay.agent._state import (
    OutsideState,
    ReceiveTargets,
    Stateful,
    as_bytes,
    load_entries,
    outside_state,
    pack_state,
    read_header,
    receive_targets,
    restore_outside_state,
    split_by_arrival,
    state_digest,
    warm_serialization,
)
from torchrelay.contract import (
    EXIT_APPLICATION_ERROR,
    EXIT_FENCED,
    AgentReport,
    Generation,
    Heartbeat,
    MigrationMode,
    ReportKind,
    Role,
    Subjects,
    make_event_id,
)

log = logging.getLogger("torchrelay.agent")

HEARTBEAT_MIN_INTERVAL_S = 0.2  # step heartbeats: at most 5 per second
LIVENESS_INTERVAL_S = 0.5


def _env(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    if value is None:
        raise AgentError(
            f"{name} is not set: start training scripts with `torchrelay run "
            "--nproc N SCRIPT` (it sets the job's environment)"
        )
    return value


def _nats_url() -> str:
    url = os.environ.get("NATS_URL")
    if url:
        return url
    home = Path(os.environ.get("TORCHRELAY_HOME", ".torchrelay"))
    try:
        return str(json.loads((home / "stack.json").read_text())["nats_url"])
    except (OSError, ValueError, KeyError) as exc:
        raise AgentError(
            "no torchrelay stack: run `torchrelay up --detach` or set NATS_URL"
        ) from exc


@dataclass
class _PendingState:
    """A received state whose modules are loaded while the rest is still arriving."""

    gen: Generation
    pg: Any
    skeleton: Any
    large: list[torch.Tensor]
    works: list[Any]
    loaded: list[str]
    targets: ReceiveTargets


class Job:
    """This process's membership in a torchrelay job (create it with :func:`init`)."""

    def __init__(
        self,
        *,
        collective_timeout_s: float | None = None,
        connect_timeout_s: float = 30.0,
        verify_every: int | None = None,
        overlap: bool | None = None,
        bucket_mb: float | None = None,
    ) -> None:
        self.verify_every = _verify_every(verify_every)
        bucket_bytes = _bucket_bytes(overlap, bucket_mb)
        # First: from here on, the launcher learns of this process's death as it begins.
        deathlatch.hold_from_env()
        self.job_id = _env("TORCHRELAY_JOB_ID")
        self.member_id = _env("TORCHRELAY_MEMBER_ID", f"{self.job_id}-pid{os.getpid()}")
        self.role = Role(_env("TORCHRELAY_ROLE", "worker"))
        self.node = _env("TORCHRELAY_NODE", "local-0")
        self.gpu = int(_env("TORCHRELAY_GPU", "0"))
        self.cluster = _env("TORCHRELAY_CLUSTER", "local")
        self.tenant = _env("TORCHRELAY_TENANT", "default")
        self.run_dir = Path(_env("TORCHRELAY_RUN_DIR", "."))
        try:
            self._chaos = ChaosPoint(os.environ.get(CHAOS_ENV), self.member_id)
        except ValueError as exc:
            raise AgentError(str(exc)) from None
        timeout_s = collective_timeout_s or float(
            os.environ.get("TORCHRELAY_COLLECTIVE_TIMEOUT_S", "60")
        )
        host = os.environ.get("TORCHRELAY_ADVERTISE_HOST", "127.0.0.1")
        self.backend = Backend.detect(self.gpu, timeout_s, host)
        self.overlap = bucket_bytes is not None

        self._lock = threading.Lock()
        self._wakeup = Wakeup()
        self._latest: Generation | None = None  # newest generation seen (net thread writes)
        self._latest_immediate = 0  # newest generation number with mode immediate
        self._ever_named = False
        self._leaving_at_boundary = False
        self._named_t: float | None = None
        self._exiting = False

        self._gen: Generation | None = None  # the generation the training thread runs in
        self._pg: Any = None
        self._rank: int | None = None
        self._tracked: dict[str, Stateful] = {}
        self._has_state = self.role == Role.WORKER
        self._committed = -1
        self._regroup = True
        self._in_step: int | None = None
        self._step_called = False
        self._last_commit_t: float | None = None
        self._disrupted_t: float | None = None  # when this rank first learnt of the change
        self._lost_steps = 0
        self._resume: dict[str, Any] | None = None
        # What a step that did not commit may have changed outside the agent (a scheduler
        # stepped whatever job.step() returned): put back before the step is yielded again.
        self._rollback: OutsideState | None = None
        self._pending: _PendingState | None = None  # state of the last sync still arriving
        self._reducer = Reducer(self.backend.device, bucket_bytes)
        self._feed: Feed | None = None
        self._positions: list[bytes] | None = None  # the step's exchanged loader positions
        # A committed step whose optimizer step the loop still runs (reduce_gradients):
        # the divergence guard and a boundary switch wait for it.
        self._after: tuple[Generation, int, bool] | None = None
        self._last_step_hb = 0.0
        self._step_time: float | None = None
        self._step_started: float | None = None
        self._finished = False
        self._exit_status = 0
        # Where to append this member's recovery timeline (wall-clock phases), if anywhere.
        timeline = os.environ.get("TORCHRELAY_AGENT_TIMELINE")
        self._timeline = Path(timeline) / f"{self.member_id}.timeline" if timeline else None

        # The rendezvous store every member hosts; a generation names whose one is used.
        self._store = TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=self.backend.timeout
        )
        self.store_addr = f"{host}:{self._store.port}"

        self._net = NetThread(
            _nats_url(),
            f"agent-{self.member_id}",
            os.environ.get("TORCHRELAY_NATS_CREDENTIALS") or None,
            connect_timeout_s,
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
        if self._rank is not None:
            return self._rank
        with self._lock:
            latest = self._latest
        rank = latest.member_rank(self.member_id) if latest is not None else None
        if rank is None:
            raise AgentError("this process holds no rank yet")
        return rank

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
        return self._gen.generation if self._gen is not None else 0

    @property
    def committed_step(self) -> int:
        """The last step committed on every live rank (-1 before the first)."""
        return self._committed

    @property
    def device(self) -> torch.device:
        """Where collectives run: the CUDA device under NCCL, else the CPU."""
        return self.backend.device

    # ------------------------------------------------------------------ generations

    def _on_generation(self, gen: Generation) -> None:
        """Net thread: record a generation; fence at once if it drops us immediately."""
        with self._lock:
            if gen.job_id != self.job_id or (
                self._latest is not None and gen.generation <= self._latest.generation
            ):
                return
            self._latest = gen
            if gen.mode == MigrationMode.IMMEDIATE:
                self._latest_immediate = gen.generation
            named = gen.member_rank(self.member_id) is not None
            if named:
                self._ever_named = True
            if gen.mode == MigrationMode.BOUNDARY and self.member_id in gen.departing:
                # Told to leave at the next step boundary. A later boundary generation
                # (a second rank drained right after) no longer lists us as departing,
                # but we still leave at that boundary, not mid-step.
                self._leaving_at_boundary = True
            drop_now = (
                not named
                and self._ever_named
                and (
                    gen.mode == MigrationMode.IMMEDIATE
                    or (self.member_id not in gen.departing and not self._leaving_at_boundary)
                    or self._gen is None
                )
            )
            if named and self._named_t is None:
                self._named_t = time.monotonic()
            if self._disrupted_t is None and self._gen is not None:
                self._disrupted_t = time.monotonic()
            if drop_now:
                self._exiting = True
        self._wakeup.set()
        self._mark("generation_seen", generation=gen.generation)
        if drop_now:
            # On the net thread: the report must go out from this loop before we exit.
            self._net.submit(
                self._fence_from_loop(f"generation {gen.generation} does not name {self.member_id}")
            )

    def _superseded(self, gen: Generation) -> Callable[[], bool]:
        """Whether any generation newer than ``gen`` is known (or we are exiting)."""

        def check() -> bool:
            latest = self._latest
            return self._exiting or (latest is not None and latest.generation > gen.generation)

        return check

    def _stale(self, gen: Generation) -> Callable[[], bool]:
        """Whether a generation newer than ``gen`` requires leaving it at once."""
        return lambda: self._latest_immediate > gen.generation or self._exiting

    def _named_generation(self) -> Generation:
        """Block until the newest generation names this member (fence if it never will)."""
        while True:
            with self._lock:
                latest = self._latest
            if latest is not None and latest.member_rank(self.member_id) is not None:
                return latest
            if latest is not None and self._ever_named:
                self._fence(f"generation {latest.generation} does not name {self.member_id}")
            self._wait_newer_than(latest)

    def _wait_newer_than(self, seen: Generation | None) -> None:
        self._wakeup.wait_for(lambda: self._latest is not seen, lambda: False, slice_s=5.0)

    def _store_for(self, gen: Generation) -> Any:
        """A fresh client of the generation's store (runs on the rendezvous thread).

        Never shared between generations: a TCPStore client serialises its calls, so an
        abandoned rendezvous still blocked in ``wait`` on a shared client would hold up
        the next generation's rendezvous until the store timeout.
        """
        host, _, port = gen.store_addr.rpartition(":")
        return TCPStore(
            host, int(port), is_master=False, wait_for_workers=False, timeout=self.backend.timeout
        )

    def _store_factory(self, gen: Generation) -> Callable[[], Any]:
        """Builds generation ``gen``'s store, under its own prefix, on the rendezvous thread."""
        return lambda: PrefixStore(f"{self.job_id}/g{gen.generation}", self._store_for(gen))

    def _enter_generation(self) -> None:
        """Join the newest generation naming us and bring every rank to the same state."""
        while True:
            gen = self._named_generation()
            self._drop_pending()  # state still arriving in a group that is being left
            if self._pg is not None:
                self.backend.abandon(self._pg)
                self._pg = None
            rank = gen.member_rank(self.member_id)
            assert rank is not None
            # While the group forms no step is in flight, so any newer generation (boundary
            # mode too) supersedes this one: members that saw the newer one first never join
            # this group, and waiting for them would last until the rendezvous timeout.
            stale = self._superseded(gen)
            self._mark("forming", generation=gen.generation)
            try:
                pg = form_group(
                    self.backend,
                    self._store_factory(gen),
                    rank,
                    gen.world_size,
                    self._wakeup,
                    stale,
                )
            except Abandoned:
                continue
            except CollectiveError as exc:
                self._collective_failed(gen, rank, exc)
                continue
            self._gen, self._pg, self._rank = gen, pg, rank
            self._mark("group_formed", generation=gen.generation)
            try:
                # Once the group formed every member is in it: like a step, the sync is
                # left only for an immediate generation (a boundary one is entered after).
                received = self._sync_state(gen, pg, rank, self._stale(gen))
            except Abandoned:
                continue
            except CollectiveError as exc:
                self._collective_failed(gen, rank, exc)
                continue
            self._regroup = False
            self._mark("state_synced", generation=gen.generation, bytes_received=received)
            self._resume = {
                "generation": gen.generation,
                "rank": rank,
                "bytes_received": received,
                "lost_steps": self._lost_steps,
                "step": self._committed + 1,
            }
            return

    def _sync_state(self, gen: Generation, pg: Any, rank: int, stale: Callable[[], bool]) -> int:
        """Agree on the highest committed step; its holders send their state below it.

        Before the job's first commit the start rule applies instead (DDP's start): every
        rank whose state differs from the lowest holder's receives that holder's.
        Returns the number of state bytes this rank received.
        """
        dev = self.backend.device
        mine = torch.tensor(
            [self._committed if self._has_state else NO_STATE], dtype=torch.int64, device=dev
        )
        outs = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(gen.world_size)]
        self._run(pg.allgather([outs], [mine]), pg, stale)
        steps = [int(t.item()) for t in outs]
        best = max(steps)
        if best == NO_STATE:
            raise AgentError(f"no member of generation {gen.generation} holds any state")
        # Before the first commit: DDP's start; after it, the holders of the newest step.
        if best < 0:
            coll = self._collectives(pg, rank, stale)
            sources = start_sources(coll, steps, self._tracked, self._has_state)
        else:
            sources = state_sources(steps)
        return self._transfer(gen, pg, rank, sources, best, stale)

    def _collectives(self, pg: Any, rank: int, stale: Callable[[], bool]) -> Collectives:
        """This rank's exchanges in ``pg``, each left like any collective (:meth:`_run`)."""
        return Collectives(pg, self.backend.device, rank, lambda work: self._run(work, pg, stale))

    def _transfer(
        self,
        gen: Generation,
        pg: Any,
        rank: int,
        sources: dict[int, int],
        best: int,
        stale: Callable[[], bool],
    ) -> int:
        """Send this rank's state to the ranks it serves in ``sources``, or receive its own.

        Returns the number of state bytes this rank received.
        """
        dev = self.backend.device
        receivers = sorted(sources)
        tag = gen.generation
        sending_to = [dst for dst in receivers if sources[dst] == rank]
        if sending_to:
            packed = pack_state(self._tracked, best, dev)
            size = torch.tensor([packed.header.numel()], dtype=torch.int64, device=dev)
            # Post every send at once (header, then each large tensor straight from the
            # state); the group's transport streams them back to back.
            works = [
                pg.send([t], dst, tag)
                for dst in sending_to
                for t in (size, packed.header, *packed.large)
            ]
            self._chaos.hit("send_state", best + 1)
            for work in works:
                self._run(work, pg, stale)
            return 0
        if rank in sources:
            source = sources[rank]
            size = torch.zeros(1, dtype=torch.int64, device=dev)
            self._run(pg.recv([size], source, tag), pg, stale)
            header = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
            self._run(pg.recv([header], source, tag), pg, stale)
            skeleton = read_header(header)
            if int(skeleton["step"]) != best:
                raise AgentError(f"recovery source sent step {skeleton['step']}, expected {best}")
            early, count = split_by_arrival(skeleton, self._tracked)
            self._has_state = False  # until all of it arrived (see _settle_state)
            targets = receive_targets(skeleton, self._tracked, dev)
            large = targets.tensors
            works = [pg.recv([as_bytes(t)], source, tag) for t in large]
            self._chaos.hit("recv_state", best + 1)
            # The modules come first: load them and let the step's forward and backward run
            # while the rest (optimizer state) still arrives; step() waits for it.
            try:
                for work in works[:count]:
                    self._run(work, pg, stale)
            except (Abandoned, CollectiveError):
                _abandon_receive(works, targets)
                raise
            load_entries(skeleton, large, self._tracked, early)
            self._rollback = None  # the received state is the step's, whatever was undone
            self._drop_gradients()
            self._committed = best
            self._pending = _PendingState(gen, pg, skeleton, large, works[count:], early, targets)
            if count == len(works):
                self._settle_state()
            return int(header.numel()) + sum(t.numel() * t.element_size() for t in large)
        return 0

    def _settle_state(self) -> None:
        """Wait for the state still arriving from the last sync and load it.

        Until then this member does not count as holding the state (``_has_state``): if
        the group fails meanwhile, the next generation sends it the whole state again.

        Raises:
            Abandoned, CollectiveError: the group was left before the state arrived.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            for work in pending.works:
                self._run(work, pending.pg, self._stale(pending.gen))
        except (Abandoned, CollectiveError):
            _abandon_receive(pending.works, pending.targets)
            raise
        late = [name for name in self._tracked if name not in pending.loaded]
        load_entries(pending.skeleton, pending.large, self._tracked, late)
        self._has_state = True
        if pending.works:
            self._mark("state_settled", generation=pending.gen.generation)

    def _drop_pending(self) -> None:
        """Give up a state still arriving (its group is being left)."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.works:
            _abandon_receive(pending.works, pending.targets)

    def _run(self, work: Any, pg: Any, stale: Callable[[], bool]) -> None:
        """Wait for ``work``; on Abandoned/CollectiveError the group is given up for good."""
        try:
            wait_work(work, self._wakeup, stale)
        except (Abandoned, CollectiveError):
            self.backend.abandon(pg, work)
            if pg is self._pg:
                self._pg = None
            self._regroup = True
            raise

    def _collective_failed(self, gen: Generation, rank: int, exc: CollectiveError) -> None:
        """Report the failure and wait until a newer generation is known."""
        self._mark("collective_failed", generation=gen.generation)
        self._report(
            ReportKind.COLLECTIVE_FAILED,
            generation=gen.generation,
            rank=rank,
            step=self._committed + 1,
            peer_rank=exc.peer_rank,
            error=str(exc)[:8000],
            event_id=make_event_id(
                "collective_failed", self.member_id, gen.generation, self._committed + 1
            ),
        )
        with self._lock:
            if self._disrupted_t is None:
                self._disrupted_t = time.monotonic()
        self._wakeup.wait_for(
            lambda: self._latest is not None and self._latest.generation > gen.generation,
            lambda: False,
            slice_s=5.0,
        )

    # ------------------------------------------------------------------ public API

    def track(self, **stateful: Stateful) -> None:
        """Register objects whose state moves with the rank (model, optimizer, scheduler...).

        Every process of the job must track the same names.
        """
        for name, obj in stateful.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"job.track({name}=...) needs state_dict() and load_state_dict()")
            self._tracked[name] = obj

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
        self._feed = feed = self._make_feed(
            dataset, batch_size, seed, shuffle, collate_fn, accumulate
        )
        while True:
            self._end_step()
            if self._regroup or self._pg is None:
                self._enter_generation()
            gen = self._gen
            assert gen is not None
            assert self._rank is not None
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

    def _make_feed(
        self,
        data: Any,
        batch_size: int | None,
        seed: int,
        shuffle: bool,
        collate_fn: Callable[[list[Any]], Any] | None,
        accumulate: int,
    ) -> Feed:
        """The feed for what the loop passed to :meth:`batches` (see ``_feed``)."""
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate must be a whole number >= 1, got {accumulate!r}")
        sampler = getattr(data, "batch_sampler", None)
        if isinstance(sampler, StepBatchSampler):
            if batch_size is not None:
                raise ValueError(
                    "job.batches(loader, ...): the loader's job.sampler() sets the batch "
                    "size; leave batch_size out"
                )
            return LoaderFeed(data, sampler, accumulate)
        if callable(getattr(data, "state_dict", None)) and callable(
            getattr(data, "load_state_dict", None)
        ):
            positions = DataPositions()
            self._tracked[POSITIONS] = positions
            return StatefulFeed(data, positions, seed, accumulate)
        if isinstance(data, torch.utils.data.DataLoader):
            raise AgentError(
                "job.batches cannot know which batch of a plain DataLoader belongs to a step: "
                "build it with batch_sampler=job.sampler(dataset, batch_size), or use "
                "torchdata's StatefulDataLoader, whose position moves with the rank"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(
                f"job.batches(dataset, batch_size, max_steps) needs a positive batch_size, "
                f"got {batch_size!r}"
            )
        return MapFeed(
            data,
            batch_size,
            seed=seed,
            shuffle=shuffle,
            collate_fn=collate_fn,
            accumulate=accumulate,
        )

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
            self._collective_failed(gen, self.rank, exc)
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
            self._collective_failed(gen, self.rank, exc)
            return False
        done = int(flag.item()) >= gen.world_size * (max_steps - 1)
        if done and self.verify_every and not self._verify(gen, pg):
            return False  # the check was cut short by a new generation: agree again there
        return done

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
        """After the loop's optimizer step: the divergence guard, a boundary switch."""
        after, self._after = self._after, None
        if after is None:
            return
        gen, step, switch = after
        if self.verify_every and (step + 1) % self.verify_every == 0 and self._pg is not None:
            self._verify(gen, self._pg)
        if switch:
            self._switch_at_boundary(gen)

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
        the job naming the first rank that differs from rank 0 and the first entry.

        Returns False when a collective failed or was left for a newer generation: the
        check is skipped (the next generation's sync starts every rank from one state).

        Raises:
            DivergenceError: two ranks hold different states.
        """
        rank = self._rank
        assert rank is not None
        try:
            found = find_divergence(
                self._collectives(pg, rank, self._stale(gen)), self._tracked, self._committed
            )
        except Abandoned:
            return False
        except CollectiveError as exc:
            self._collective_failed(gen, rank, exc)
            return False
        if found is None:
            return True
        raise DivergenceError(
            f"torchrelay divergence guard: after step {self._committed} in generation "
            f"{gen.generation} rank {found.ranks[0]}'s tracked state differs from rank 0's, "
            f"first in {found.path} (ranks that differ: {found.ranks}); the job is stopped "
            "because its ranks no longer train one model"
        )

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

    def _switch_at_boundary(self, gen: Generation) -> None:
        """After the agreed commit: leave for the newer generation, or exit if dropped."""
        self._wakeup.wait_for(
            lambda: self._latest is not None and self._latest.generation > gen.generation,
            lambda: False,
        )
        with self._lock:
            latest = self._latest
        assert latest is not None
        if latest.member_rank(self.member_id) is None:
            self._fence(f"left at the step boundary for generation {latest.generation}")
        if self._pg is not None:
            self.backend.abandon(self._pg)
            self._pg = None
        self._regroup = True

    def finish(self) -> None:
        """Report that this rank finished and close the connection (call once, at the end)."""
        if self._finished:
            return
        self._finished = True
        self._after = None
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

    # ------------------------------------------------------------------ reports, exits

    def _run_warm_up(self, warm_up: Callable[[], object]) -> None:
        """Run a spare's warm-up (see :func:`init`); a failure is reported, never fatal."""
        started = time.perf_counter()
        try:
            warm_up()
        except Exception as exc:
            print(
                f"torchrelay: {self.member_id}: warm_up raised {type(exc).__name__}: {exc}; "
                "the spare serves without warm-up",
                file=sys.stderr,
                flush=True,
            )
            self._mark("warm_up_failed", error=repr(exc))
            return
        self._mark("warmed_up", ms=round(1000 * (time.perf_counter() - started), 1))

    def _drop_gradients(self) -> None:
        """Forget the gradients of every tracked module's and optimizer's parameters.

        Called when this rank's state is replaced by a received one: gradients computed on
        the old state (a spare's warm-up, a step that will be yielded again) must not be
        accumulated into the first backward on the new one.
        """
        for obj in self._tracked.values():
            if isinstance(obj, torch.nn.Module | torch.optim.Optimizer):
                obj.zero_grad(set_to_none=True)

    def _mark(self, event: str, **fields: Any) -> None:
        """Append a timed event to ``$TORCHRELAY_AGENT_TIMELINE/<member>.timeline``, if set.

        The recovery path's phases (generation seen, group formed, state synced, resumed)
        in wall-clock time, to line up with the services' logs when a stall is analysed.
        """
        if self._timeline is None:
            return
        line = json.dumps({"t": time.time(), "event": event, **fields})
        try:
            with self._timeline.open("a") as out:
                out.write(line + "\n")
        except OSError:
            self._timeline = None  # a broken debug aid must never hurt training

    def _make_report(self, kind: ReportKind, *, event_id: str, **fields: Any) -> AgentReport:
        fields.setdefault("rank", self._rank)
        return AgentReport(
            event_id=event_id,
            source=f"agent:{self.member_id}",
            job_id=self.job_id,
            member_id=self.member_id,
            kind=kind,
            role=self.role,
            node=self.node,
            gpu=self.gpu,
            pid=os.getpid(),
            cluster=self.cluster,
            **fields,
        )

    def _report(self, kind: ReportKind, *, event_id: str, **fields: Any) -> None:
        self._net.publish(
            self._make_report(kind, event_id=event_id, **fields), Subjects.agent_report(self.job_id)
        )

    def _heartbeat(self, kind: Literal["step", "liveness"]) -> None:
        beat = Heartbeat(
            event_id=make_event_id("hb", self.member_id, kind, time.time_ns()),
            source=f"agent:{self.member_id}",
            job_id=self.job_id,
            member_id=self.member_id,
            rank=self._rank,
            generation=self.generation,
            step=self._committed,
            step_time_s=self._step_time,
            kind=kind,
            node=self.node,
            gpu=self.gpu,
            pid=os.getpid(),
            cluster=self.cluster,
        )
        self._net.publish_core(Subjects.heartbeat(self.job_id), beat)

    def _liveness(self) -> None:
        self._heartbeat("liveness")

    def _fenced_report(self, why: str) -> AgentReport:
        return self._make_report(
            ReportKind.FENCED,
            generation=self.generation,
            error=why,
            step=self._committed,
            event_id=make_event_id("fenced", self.member_id, self.generation),
        )

    def _fence(self, why: str) -> NoReturn:
        """Exit with EXIT_FENCED: another process holds our rank; nothing more is committed."""
        self._exiting = True
        self._net.publish(self._fenced_report(why), Subjects.agent_report(self.job_id))
        self._net.flush(2.0)
        print(f"torchrelay: {self.member_id} fenced: {why}", file=sys.stderr, flush=True)
        _hard_exit(EXIT_FENCED)

    async def _fence_from_loop(self, why: str) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                self._net.bus.publish(self._fenced_report(why), Subjects.agent_report(self.job_id)),
                2.0,
            )
        print(f"torchrelay: {self.member_id} fenced: {why}", file=sys.stderr, flush=True)
        _hard_exit(EXIT_FENCED)

    def _write_exit_record(self, record: dict[str, Any]) -> None:
        """``<RUN_DIR>/<member_id>.exit.json``: what the launcher reads when we exit."""
        with contextlib.suppress(OSError):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / f"{self.member_id}.exit.json").write_text(json.dumps(record))

    def _install_exit_hooks(self) -> None:
        previous = sys.excepthook

        def _hook(
            exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
        ) -> None:
            if issubclass(exc_type, KeyboardInterrupt):
                previous(exc_type, exc, tb)
                _hard_exit(130)
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            self._write_exit_record({"kind": "application_error", "error": text[-8000:]})
            with contextlib.suppress(Exception):
                self._report(
                    ReportKind.APPLICATION_ERROR,
                    generation=self.generation,
                    step=self._committed,
                    error=text[-8000:],
                    event_id=make_event_id("application_error", self.member_id),
                )
                self._net.flush(3.0)
            previous(exc_type, exc, tb)
            # Exit now: abandoned groups and the net thread must not delay the exit.
            _hard_exit(EXIT_APPLICATION_ERROR)

        sys.excepthook = _hook
        previous_exit = sys.exit

        def _exit(status: str | int | None = None) -> NoReturn:
            self._exit_status = _status_code(status)
            previous_exit(status)

        sys.exit = _exit
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        """End a process that left a group mid-collective without running C++ teardown.

        Such a group's pending operation fails when its peers exit, and gloo raises that
        error on its own thread; during the interpreter's teardown this aborts the process
        (SIGABRT), which the launcher would count as a lost worker after a clean finish.
        """
        if GRAVEYARD.in_flight:
            logging.shutdown()
            _hard_exit(self._exit_status)


def _status_code(status: object) -> int:
    """The process exit code ``sys.exit(status)`` produces."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status
    return 1


def _abandon_receive(works: list[Any], targets: ReceiveTargets) -> None:
    """Leave a state transfer: what its pending receives may still write stays allocated
    (in the graveyard), and the live state stops using any of it."""
    GRAVEYARD.keep(*works, *targets.tensors)
    targets.release_live()


def _verify_every(given: int | None) -> int:
    """The divergence guard's period: ``given``, else ``TORCHRELAY_VERIFY_EVERY``, else 0."""
    if given is None:
        raw = os.environ.get("TORCHRELAY_VERIFY_EVERY", "").strip() or "0"
        try:
            given = int(raw)
        except ValueError:
            raise AgentError(
                f"TORCHRELAY_VERIFY_EVERY={raw!r} is not a whole number of steps; "
                "set it to N >= 1 to compare the ranks' state every N steps, or 0 for never"
            ) from None
    if isinstance(given, bool) or not isinstance(given, int) or given < 0:
        raise AgentError(
            f"verify_every={given!r}: give a whole number of steps >= 1 to compare the "
            "ranks' state every N steps, or 0 for never"
        )
    return given


def _bucket_bytes(overlap: bool | None, bucket_mb: float | None) -> int | None:
    """The overlap's bucket size in bytes, or None for one flat all-reduce after backward.

    ``overlap`` defaults to ``TORCHRELAY_OVERLAP`` (on unless "0"), ``bucket_mb`` to
    ``TORCHRELAY_BUCKET_MB`` (25, as DDP's ``bucket_cap_mb``).
    """
    if overlap is None:
        raw = os.environ.get("TORCHRELAY_OVERLAP", "1").strip().lower()
        if raw not in ("0", "1", "true", "false", "on", "off", ""):
            raise AgentError(
                f"TORCHRELAY_OVERLAP={raw!r}: set it to 1 (buckets during backward) or 0"
            )
        overlap = raw not in ("0", "false", "off")
    if not overlap:
        return None
    if bucket_mb is None:
        raw = os.environ.get("TORCHRELAY_BUCKET_MB", "").strip()
        try:
            bucket_mb = float(raw) if raw else DEFAULT_BUCKET_MB
        except ValueError:
            raise AgentError(f"TORCHRELAY_BUCKET_MB={raw!r} is not a number of megabytes") from None
    if isinstance(bucket_mb, bool) or not bucket_mb > 0:
        raise AgentError(f"bucket_mb={bucket_mb!r}: give a positive number of megabytes")
    return max(1, int(bucket_mb * 1024 * 1024))


def _hard_exit(code: int) -> NoReturn:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


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
    """
    if warm_up is not None and not callable(warm_up):
        raise TypeError(f"torchrelay.init(warm_up=...) needs a callable, got {warm_up!r}")
    job = Job(**kwargs)
    if job.role == Role.SPARE:
        _warm_up()
        if warm_up is not None:
            job._run_warm_up(warm_up)
    job._named_generation()
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
