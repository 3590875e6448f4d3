"""Generations are built by pure functions: formation from JOINED reports, rank replacement."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrelay.contract import AgentReport, MigrationMode, ReportKind, Role
from torchrelay.generations import (
    Candidate,
    GenerationError,
    changed_event,
    form_first,
    member_order,
    replace_rank,
    restart_generation,
)


def joined(job: str, member: str, role: Role = Role.WORKER, port: int = 1000) -> AgentReport:
    return AgentReport(
        event_id=f"j-{member}",
        source="t",
        job_id=job,
        member_id=member,
        kind=ReportKind.JOINED,
        role=role,
        node="local-0",
        gpu=port % 8,
        store_addr=f"127.0.0.1:{port}",
    )


def test_member_order_puts_workers_by_index_then_spares() -> None:
    ids = ["j-s1", "j-w10", "j-w2", "j-s0", "j-w0", "odd"]
    assert sorted(ids, key=member_order) == ["j-w0", "j-w2", "j-w10", "j-s0", "j-s1", "odd"]


def test_first_generation_waits_for_every_worker() -> None:
    reports = [joined("j", "j-w1", port=1001), joined("j", "j-s0", Role.SPARE, 1009)]
    assert form_first("j", 2, reports) is None


def test_first_generation_ranks_workers_in_member_order() -> None:
    reports = [
        joined("j", "j-w1", port=1001),
        joined("j", "j-s0", Role.SPARE, 1009),
        joined("other", "other-w0", port=1500),
        joined("j", "j-w0", port=1000),
    ]
    gen = form_first("j", 2, reports)
    assert gen is not None
    assert gen.generation == 1
    assert [(a.rank, a.member_id) for a in gen.ranks] == [(0, "j-w0"), (1, "j-w1")]
    assert gen.store_member == "j-w0"
    assert gen.store_addr == "127.0.0.1:1000"
    assert gen.mode == MigrationMode.IMMEDIATE
    assert gen.reason == "formed"
    event = changed_event(gen, "test")
    assert event.previous == 0
    assert event.event_id == changed_event(gen, "other").event_id  # deterministic id


def test_replacing_a_rank_keeps_its_number_and_moves_the_store_off_the_leaver() -> None:
    reports = [joined("j", f"j-w{i}", port=1000 + i) for i in range(3)]
    gen = form_first("j", 3, reports)
    assert gen is not None
    spare = Candidate("j-s0", "local-1", 0, "127.0.0.1:2000")
    nxt = replace_rank(
        gen,
        0,
        spare,
        mode=MigrationMode.IMMEDIATE,
        store_addrs={r.member_id: r.store_addr or "" for r in reports},
        migration_id="m1",
    )
    assert nxt.generation == 2
    assert nxt.member_rank("j-s0") == 0
    assert nxt.member_rank("j-w0") is None
    assert nxt.departing == ["j-w0"]
    assert nxt.store_member == "j-w1"  # lowest rank not being replaced
    assert nxt.store_addr == "127.0.0.1:1001"
    assert nxt.migration_id == "m1"


def test_replacement_errors_name_the_problem() -> None:
    gen = form_first("j", 2, [joined("j", "j-w0", port=1000), joined("j", "j-w1", port=1001)])
    assert gen is not None
    with pytest.raises(GenerationError, match="no rank 5"):
        replace_rank(
            gen, 5, Candidate("j-s0", "n", 0), mode=MigrationMode.IMMEDIATE, store_addrs={}
        )
    with pytest.raises(GenerationError, match="already holds rank"):
        replace_rank(
            gen, 0, Candidate("j-w1", "n", 0), mode=MigrationMode.IMMEDIATE, store_addrs={}
        )
    with pytest.raises(GenerationError, match="no store address known for j-w1"):
        replace_rank(gen, 0, Candidate("j-s0", "n", 0), mode=MigrationMode.BOUNDARY, store_addrs={})


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 8), victims=st.lists(st.integers(0, 7), min_size=1, max_size=5))
def test_any_replacement_sequence_keeps_a_valid_world(world: int, victims: list[int]) -> None:
    reports = [joined("j", f"j-w{i}", port=1000 + i) for i in range(world)]
    addrs = {r.member_id: r.store_addr or "" for r in reports}
    gen = form_first("j", world, reports)
    assert gen is not None
    for n, victim in enumerate(v % world for v in victims):
        spare = Candidate(f"j-s{n}", "local-0", n, f"127.0.0.1:{2000 + n}")
        addrs[spare.member_id] = spare.store_addr or ""
        old = gen.ranks[victim].member_id
        gen = replace_rank(gen, victim, spare, mode=MigrationMode.IMMEDIATE, store_addrs=addrs)
        assert sorted(a.rank for a in gen.ranks) == list(range(world))
        assert len({a.member_id for a in gen.ranks}) == world
        assert gen.store_member != old
        assert gen.member_rank(gen.store_member) is not None
        assert gen.store_addr == addrs[gen.store_member]


def test_a_restart_generation_names_the_new_members_after_the_current_one() -> None:
    first = form_first("j", 2, [joined("j", "j-w0", port=1000), joined("j", "j-w1", port=1001)])
    assert first is not None
    new = [joined("j", "j-r1-w1", port=2001), joined("j", "j-r1-w0", port=2000)]
    gen = restart_generation(first, 2, new)
    assert gen.generation == 2
    assert [(a.rank, a.member_id) for a in gen.ranks] == [(0, "j-r1-w0"), (1, "j-r1-w1")]
    assert gen.store_member == "j-r1-w0"
    assert gen.store_addr == "127.0.0.1:2000"
    assert gen.reason == "checkpoint_restart"
    with pytest.raises(GenerationError, match="world size 3 has 2 members"):
        restart_generation(first, 3, new)
