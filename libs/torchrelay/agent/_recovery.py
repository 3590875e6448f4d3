"""Recovery: following the job's generations, forming each generation's group, and bringing
every rank to the committed state (docs/design.md §4)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch._C._distributed_c10d import PrefixStore, TCPStore

from torchrelay.agent._agree import NO_STATE, Collectives, start_sources, state_sources
from torchrelay.agent._errors import AgentError
from torchrelay.agent._group import (
    GRAVEYARD,
    Abandoned,
    CollectiveError,
    form_group,
    wait_work,
)
from torchrelay.agent._hooks import ProcessHooks
from torchrelay.agent._mesh import MESH_GROUPS
from torchrelay.agent._shards import replica_mask, shard_classes, shard_sources
from torchrelay.agent._state import (
    PendingState,
    ReceiveTargets,
    as_bytes,
    load_entries,
    pack_state,
    read_header,
    receive_targets,
    split_by_arrival,
    state_leaves,
)
from torchrelay.contract import Generation, MigrationMode, ReportKind, make_event_id


class Recovery(ProcessHooks):
    """Generations in, a formed group and one committed state out."""

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
            if self._gen is not None and gen.world_size < self._gen.world_size and rank == 0:
                self._say_shrunk(self._gen.world_size, gen.world_size)
            self._gen, self._pg, self._rank = gen, pg, rank
            if self._sharded:
                self._rebind_mesh(gen)
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
            # A checkpoint due where a generation begins is skipped: not every rank of the
            # new generation would take it (a spare never saw the old one's decision).
            self._checkpoint_last = max(self._checkpoint_last, self._committed + 1)
            self._mark("state_synced", generation=gen.generation, bytes_received=received)
            self._resume = {
                "generation": gen.generation,
                "rank": rank,
                "bytes_received": received,
                "lost_steps": self._lost_steps,
                "step": self._committed + 1,
            }
            return

    def _say_shrunk(self, before: int, after: int, what: str = "") -> None:
        """The job shrank (policy shrink, or a restart on fewer slots, ``what`` saying so):
        what changed in the step's math."""
        per_rank = getattr(self._feed, "batch_size", None)
        batch = (
            f"{after} x {per_rank} = {after * per_rank} samples (was {before * per_rank})"
            if isinstance(per_rank, int)
            else f"{after}/{before} of what it was"
        )
        print(
            f"torchrelay: {what or f'the job shrank from {before} to {after} ranks'}: "
            f"each step now "
            f"averages {after} ranks' batches, so the global batch is {batch}; the learning "
            "rate and its schedule are unchanged, and the run no longer matches one without "
            "the fault",
            file=sys.stderr,
            flush=True,
        )

    def _rebind_mesh(self, gen: Generation) -> None:
        """Bind the mesh's groups (job.device_mesh) to transports of generation ``gen``."""
        MESH_GROUPS.rebind(
            gen.generation, self._store_factory(gen)(), self.backend.make_group, self.backend.device
        )

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
        if self._sharded:
            return self._sync_shards(gen, pg, rank, steps, stale)
        # Before the first commit: DDP's start; after it, the holders of the newest step.
        if best < 0:
            coll = self._collectives(pg, rank, stale)
            sources = start_sources(coll, steps, self._tracked, self._has_state)
        else:
            sources = state_sources(steps)
        return self._transfer(gen, pg, rank, sources, best, stale)

    def _sync_shards(
        self, gen: Generation, pg: Any, rank: int, steps: list[int], stale: Callable[[], bool]
    ) -> int:
        """A sharded job's sync: a rank below the highest committed step (a spare, a rank
        whose state is older) receives its own shard from a holder of that step in its
        shard class (HSDP's replica, a tensor-parallel shard's data-parallel peer).

        A rank whose class holds no copy of its shard at that step cannot be restored live:
        the generation is reported lost (:meth:`_state_lost`) and never trained in.
        """
        best = max(steps)
        classes, wards = self._shard_census(self._collectives(pg, rank, stale))
        self._classes = classes
        if all(s == best for s in steps):
            return 0  # each rank keeps its own shard; DDP's start does not apply
        plan = shard_sources(steps, classes)
        # A shard no live rank holds: its buddy's copy, if it is of the committed step.
        from_buddy = {
            lost: holder
            for lost in plan.unrestorable
            for holder, (ward, at) in enumerate(wards)
            if ward == lost and at == best and steps[holder] == best
        }
        lost = [r for r in plan.unrestorable if r not in from_buddy]
        if lost:
            self._state_lost(
                gen,
                rank,
                f"generation {gen.generation} cannot restore rank(s) {lost} live: no rank "
                f"holding the same shard, nor a buddy copy of it, committed step {best} "
                f"(committed steps {steps})",
            )
        sources = {**plan.sources, **from_buddy}
        return self._transfer(gen, pg, rank, sources, best, stale, set(from_buddy))

    def _state_lost(self, gen: Generation, rank: int, why: str) -> NoReturn:
        """No copy of a rank's state survives: tell the control plane, which takes the job's
        fallback (a restart from its checkpoint; docs/design.md §13), and wait for what it
        decides, a newer generation or this process's end. Never train on a wrong shard."""
        print(f"torchrelay: {self.member_id}: {why}", file=sys.stderr, flush=True)
        if rank == 0:  # every rank found the same; one report says it
            self._report(
                ReportKind.STATE_LOST,
                generation=gen.generation,
                rank=rank,
                step=self._committed + 1,
                error=why,
                event_id=make_event_id("state_lost", self.job_id, gen.generation),
            )
        self._wait_past(gen)
        raise Abandoned(why)

    def _known_classes(self, coll: Collectives) -> list[int]:
        """This generation's shard classes: from its entry's census, or (a mesh built after
        the group formed) from one taken now, on every rank at the same point of a step."""
        if self._classes is None:
            self._classes = self._shard_census(coll)[0]
        return self._classes

    def _shard_census(self, coll: Collectives) -> tuple[list[int], list[tuple[int, int]]]:
        """Each rank's shard class in the job's mesh, and the ward copy each rank holds
        (``(rank, step)``, ``(-1, -1)`` for none; docs/design.md §12). Every rank says which
        dimensions its state is replicated along (a spare's optimizer may hold no state
        yet); a dimension counts only if all of them say so."""
        mesh = self._mesh
        assert mesh is not None
        mine = replica_mask((v for _, v in state_leaves(self._tracked)), mesh)
        ward = self._ward
        held = (ward.rank, ward.step) if ward is not None else (-1, -1)
        data = b"".join(v.to_bytes(8, "little", signed=True) for v in (mine, *held))
        mask = mine
        wards: list[tuple[int, int]] = []
        for seen in coll.allgather_bytes(data):
            values = [int.from_bytes(seen[i : i + 8], "little", signed=True) for i in (0, 8, 16)]
            mask &= values[0]
            wards.append((values[1], values[2]))
        return shard_classes(mesh.mesh, mask), wards

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
        from_buddy: set[int] | None = None,
    ) -> int:
        """Send this rank's state to the ranks it serves in ``sources``, or receive its own.
        A receiver in ``from_buddy`` gets the copy its buddy holds of it instead.

        Returns the number of state bytes this rank received.
        """
        dev = self.backend.device
        receivers = sorted(sources)
        tag = gen.generation
        sending_to = [dst for dst in receivers if sources[dst] == rank]
        if sending_to:
            ward, buddied = self._ward, from_buddy or set()
            own = (
                pack_state(self._tracked, best, dev)
                if any(dst not in buddied for dst in sending_to)
                else None
            )
            # Post every send at once (header, then each large tensor straight from the
            # state); the group's transport streams them back to back. A rank's buddy
            # sends the copy it holds of that rank.
            coll = self._collectives(pg, rank, stale)
            works = []
            for dst in sending_to:
                packed = ward.packed() if ward is not None and dst in buddied else own
                assert packed is not None
                works += coll.send_packed(packed, dst, tag)
            self._chaos.hit("send_state", best + 1)
            for work in works:
                self._run(work, pg, stale)
            return 0
        if rank in sources:
            source = sources[rank]
            header = self._collectives(pg, rank, stale).recv_header(source, tag)
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
            load_entries(skeleton, large, self._tracked, early, self._mesh)
            self._rollback = None  # the received state is the step's, whatever was undone
            self._drop_gradients()
            self._committed = best
            self._pending = PendingState(gen, pg, skeleton, large, works[count:], early, targets)
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
        load_entries(pending.skeleton, pending.large, self._tracked, late, self._mesh)
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
        self._wait_past(gen)

    def _wait_past(self, gen: Generation) -> None:
        """Block until a generation newer than ``gen`` is known."""
        self._wakeup.wait_for(
            lambda: self._latest is not None and self._latest.generation > gen.generation,
            lambda: False,
            slice_s=5.0,
        )

    def _switch_at_boundary(self, gen: Generation) -> None:
        """After the agreed commit: leave for the newer generation, or exit if dropped."""
        self._wait_past(gen)
        with self._lock:
            latest = self._latest
        assert latest is not None
        if latest.member_rank(self.member_id) is None:
            self._fence(f"left at the step boundary for generation {latest.generation}")
        if self._pg is not None:
            self.backend.abandon(self._pg)
            self._pg = None
        self._regroup = True

    def _drop_gradients(self) -> None:
        """Forget the gradients of every tracked module's and optimizer's parameters.

        Called when this rank's state is replaced by a received one: gradients computed on
        the old state (a spare's warm-up, a step that will be yielded again) must not be
        accumulated into the first backward on the new one.
        """
        for obj in self._tracked.values():
            if isinstance(obj, torch.nn.Module | torch.optim.Optimizer):
                obj.zero_grad(set_to_none=True)


def _abandon_receive(works: list[Any], targets: ReceiveTargets) -> None:
    """Leave a state transfer: what its pending receives may still write stays allocated
    (in the graveyard), and the live state stops using any of it."""
    GRAVEYARD.keep(*works, *targets.tensors)
    targets.release_live()
