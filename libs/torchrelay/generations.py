"""Job generations: who holds which rank, built by pure functions and written with CAS.

A generation (``contract.Generation``) is the value of a job's key in the generations KV
bucket and the fencing token of the job (docs/design.md §2-§3). The migration executor
(and the agent's test helper that plays it) builds generations with the pure functions here
and writes them with :class:`GenerationWriter`, which compare-and-sets the KV revision and
then announces the change with a ``GenerationChanged`` event.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torchrelay.bus import Bus
from torchrelay.contract import (
    AgentReport,
    Generation,
    GenerationChanged,
    MigrationMode,
    RankAssignment,
    ReportKind,
    Role,
    Subjects,
    make_event_id,
)

_MEMBER_RE = re.compile(r"-(?P<role>[ws])(?P<index>\d+)$")


class GenerationError(ValueError):
    """A generation cannot be built from what was given; the message says what is missing."""


@dataclass(frozen=True)
class Candidate:
    """A member that can take a rank: where it runs and where its rendezvous store listens."""

    member_id: str
    node: str
    gpu: int
    store_addr: str | None = None

    @classmethod
    def from_report(cls, report: AgentReport) -> Candidate:
        """The candidate announced by a JOINED report."""
        return cls(report.member_id, report.node, report.gpu, report.store_addr)


def member_order(member_id: str) -> tuple[int, int, str]:
    """Sort key of the launcher's member ids: workers ``-w<i>`` by i, then spares ``-s<j>``.

    Ids that do not follow the launcher's pattern sort last, by name.
    """
    match = _MEMBER_RE.search(member_id)
    if match is None:
        return (2, 0, member_id)
    return (0 if match["role"] == "w" else 1, int(match["index"]), member_id)


def form_first(job_id: str, world_size: int, joined: Iterable[AgentReport]) -> Generation | None:
    """Generation 1 from the JOINED reports of the job's workers, or None while too few joined.

    Ranks go to workers in member order (``w0`` gets rank 0, ...); rank 0 hosts the
    rendezvous store. Spares' reports and reports of other jobs are ignored.

    Raises:
        GenerationError: rank 0's JOINED report carries no store address.
    """
    workers: dict[str, AgentReport] = {}
    for report in joined:
        if (
            report.job_id == job_id
            and report.kind == ReportKind.JOINED
            and report.role == Role.WORKER
        ):
            workers[report.member_id] = report
    if len(workers) < world_size:
        return None
    chosen = sorted(workers.values(), key=lambda r: member_order(r.member_id))[:world_size]
    store = chosen[0]
    if not store.store_addr:
        raise GenerationError(
            f"JOINED report of {store.member_id} has no store_addr; "
            "the agent must announce its rendezvous store"
        )
    return Generation(
        job_id=job_id,
        generation=1,
        world_size=world_size,
        ranks=[
            RankAssignment(rank=i, member_id=r.member_id, node=r.node, gpu=r.gpu)
            for i, r in enumerate(chosen)
        ],
        store_member=store.member_id,
        store_addr=store.store_addr,
        mode=MigrationMode.IMMEDIATE,
        reason="formed",
    )


def restart_generation(
    current: Generation | None, world_size: int, joined: Iterable[AgentReport]
) -> Generation:
    """The generation of a job restarted from its checkpoint: its new members in member
    order, rank 0 hosting the store, numbered after ``current`` (docs/design.md §13).

    Raises:
        GenerationError: fewer members than ``world_size``, or rank 0 has no store address.
    """
    chosen = sorted(joined, key=lambda r: member_order(r.member_id))
    if len(chosen) < world_size:
        raise GenerationError(f"a restart at world size {world_size} has {len(chosen)} members")
    chosen = chosen[:world_size]
    if not chosen[0].store_addr:
        raise GenerationError(f"JOINED report of {chosen[0].member_id} has no store_addr")
    return Generation(
        job_id=chosen[0].job_id,
        generation=(current.generation if current is not None else 0) + 1,
        world_size=world_size,
        ranks=[
            RankAssignment(rank=i, member_id=r.member_id, node=r.node, gpu=r.gpu)
            for i, r in enumerate(chosen)
        ],
        store_member=chosen[0].member_id,
        store_addr=chosen[0].store_addr,
        mode=MigrationMode.IMMEDIATE,
        reason="checkpoint_restart",
    )


def replace_rank(
    current: Generation,
    rank: int,
    spare: Candidate,
    *,
    mode: MigrationMode,
    store_addrs: Mapping[str, str],
    migration_id: str | None = None,
    reason: str = "migration",
) -> Generation:
    """Generation ``current + 1`` with ``spare`` in ``rank``'s place (same rank number).

    The store moves to the lowest rank not being replaced (its address is looked up in
    ``store_addrs``, member id -> ``host:port`` from the JOINED reports), so the rendezvous
    never depends on the member that is leaving. The old holder is listed in ``departing``.

    Raises:
        GenerationError: the rank does not exist, the spare already holds a rank, the world
            has no survivor to host the store, or the survivor's store address is unknown.
    """
    old = next((a for a in current.ranks if a.rank == rank), None)
    if old is None:
        raise GenerationError(
            f"generation {current.generation} of {current.job_id} has no rank {rank}"
        )
    if current.member_rank(spare.member_id) is not None:
        raise GenerationError(
            f"{spare.member_id} already holds rank {current.member_rank(spare.member_id)}"
        )
    ranks = [
        RankAssignment(rank=rank, member_id=spare.member_id, node=spare.node, gpu=spare.gpu)
        if a.rank == rank
        else a
        for a in sorted(current.ranks, key=lambda a: a.rank)
    ]
    survivors = [a for a in ranks if a.rank != rank]
    # A world of one has no survivor: the newcomer hosts its own store.
    host = survivors[0].member_id if survivors else spare.member_id
    addr = (
        current.store_addr
        if host == current.store_member
        else store_addrs.get(host) or (spare.store_addr if host == spare.member_id else None)
    )
    if not addr:
        raise GenerationError(
            f"no store address known for {host}; pass the addresses from "
            "the JOINED reports in store_addrs"
        )
    return Generation(
        job_id=current.job_id,
        generation=current.generation + 1,
        world_size=current.world_size,
        ranks=ranks,
        store_member=host,
        store_addr=addr,
        mode=mode,
        departing=[old.member_id],
        reason=reason,
        migration_id=migration_id,
    )


def changed_event(generation: Generation, source: str) -> GenerationChanged:
    """The ``GenerationChanged`` event announcing ``generation`` (deterministic id)."""
    return GenerationChanged(
        event_id=make_event_id("generation", generation.job_id, generation.generation),
        source=source,
        job_id=generation.job_id,
        generation=generation.generation,
        previous=generation.generation - 1,
        ranks=list(generation.ranks),
        reason=generation.reason,
        migration_id=generation.migration_id,
    )


class GenerationWriter:
    """Writes a job's generations into the KV bucket with compare-and-set, then announces them.

    Only the migration executor (or a test playing it) writes generations. Every write
    after the first names the revision it was built from, so two writers racing on one job
    cannot both win: the loser gets ``bus.StaleRevision`` and must re-read and re-decide.
    """

    def __init__(self, bus: Bus, source: str = "migration_executor") -> None:
        self._bus = bus
        self._source = source

    async def current(self, job_id: str) -> tuple[Generation, int] | None:
        """The job's generation and its KV revision, or None before generation 1."""
        return await self._bus.get_generation(job_id)

    async def write(self, generation: Generation, expected_revision: int | None) -> int:
        """Write ``generation`` (CAS on ``expected_revision``; None: the key must not exist).

        Returns the new KV revision after publishing ``GenerationChanged``.

        Raises:
            bus.StaleRevision: the key changed since ``expected_revision`` was read.
        """
        revision = await self._bus.put_generation(generation, expected_revision)
        await self._bus.publish(
            changed_event(generation, self._source), Subjects.GENERATION_CHANGED
        )
        return revision

    async def form(
        self, job_id: str, world_size: int, joined: Iterable[AgentReport]
    ) -> Generation | None:
        """Write generation 1 once ``world_size`` workers have joined; idempotent.

        Returns the job's generation 1 (the one already stored if there is one), or None
        while workers are missing.
        """
        existing = await self.current(job_id)
        if existing is not None:
            return existing[0]
        first = form_first(job_id, world_size, joined)
        if first is None:
            return None
        await self.write(first, None)
        return first

    async def replace(
        self,
        job_id: str,
        rank: int,
        spare: Candidate,
        *,
        mode: MigrationMode,
        store_addrs: Mapping[str, str],
        expected_member: str | None = None,
        migration_id: str | None = None,
        reason: str = "migration",
    ) -> Generation:
        """Read the job's generation and write the next one with ``spare`` in ``rank``.

        With ``expected_member``, the write happens only while that member still holds the
        rank; if another writer already moved it, the current generation is returned
        unchanged (a redelivered request is a no-op).

        Raises:
            GenerationError: the job has no generation yet, or the replacement is invalid.
            bus.StaleRevision: another writer changed the generation meanwhile.
        """
        found = await self.current(job_id)
        if found is None:
            raise GenerationError(f"job {job_id} has no generation to replace a rank in")
        current, revision = found
        holder = next((a.member_id for a in current.ranks if a.rank == rank), None)
        if expected_member is not None and holder != expected_member:
            return current
        nxt = replace_rank(
            current,
            rank,
            spare,
            mode=mode,
            store_addrs=store_addrs,
            migration_id=migration_id,
            reason=reason,
        )
        await self.write(nxt, revision)
        return nxt


__all__ = [
    "Candidate",
    "GenerationError",
    "GenerationWriter",
    "changed_event",
    "form_first",
    "member_order",
    "replace_rank",
]
