"""The spare pool's pure rules: request validation, locality order, floors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from services.spare_pool.rules import (
    Candidate,
    ReserveRequest,
    Topology,
    floor_for,
    parse_floors,
    pick_spare,
    pool_low_change,
    readmission_problem,
    register_conflict,
    registration_problem,
)
from torchrelay.contract import Generation, Heartbeat, RankAssignment, SpareSlot, SpareState

NEAR = Topology(nvlink_domain="nvl-a", rack="rack-1", zone="z1")


def _slot(
    slot_id: str,
    node: str = "far",
    *,
    domain: str = "nvl-x",
    rack: str = "rack-9",
    zone: str = "z9",
    state: SpareState = SpareState.IDLE,
    job_id: str | None = None,
    model: str = "H100",
    memory_mb: int = 80_000,
    cluster: str = "c1",
) -> SpareSlot:
    return SpareSlot(
        slot_id=slot_id,
        cluster=cluster,
        node=node,
        gpu=0,
        gpu_model=model,
        memory_mb=memory_mb,
        nvlink_domain=domain,
        rack=rack,
        zone=zone,
        state=state,
        job_id=job_id,
    )


def _pick(slots: list[SpareSlot], near: Topology | None = NEAR, **req: object) -> str | None:
    request = ReserveRequest.model_validate(
        {"job_id": "j1", "cluster": "c1", "near_node": "failed", **req}
    )
    picked = pick_spare([Candidate(s) for s in slots], request, near)
    return picked[0].slot_id if picked else None


def test_locality_order_is_hot_then_domain_then_rack_then_zone_then_any() -> None:
    slots = [
        _slot("any"),
        _slot("zone", zone="z1"),
        _slot("rack", rack="rack-1", zone="z1"),
        _slot("domain", domain="nvl-a", rack="rack-1", zone="z1"),
        _slot("hot", state=SpareState.HOT, job_id="j1"),
    ]
    order = []
    while slots:
        chosen = _pick(slots)
        assert chosen is not None
        order.append(chosen)
        slots = [s for s in slots if s.slot_id != chosen]
    assert order == ["hot", "domain", "rack", "zone", "any"]


def test_another_jobs_hot_spare_and_busy_slots_are_never_candidates() -> None:
    slots = [
        _slot("other-hot", state=SpareState.HOT, job_id="j2"),
        _slot("reserved", state=SpareState.RESERVED, job_id="j3"),
        _slot("in-use", state=SpareState.IN_USE, job_id="j3"),
        _slot("quarantined", state=SpareState.QUARANTINED),
        _slot("rma", state=SpareState.RMA),
        _slot("elsewhere", cluster="c2"),
    ]
    assert _pick(slots) is None


def test_excluded_nodes_and_misfits_are_skipped() -> None:
    request = ReserveRequest(job_id="j1", cluster="c1", gpu_model="H100", min_memory_mb=80_000)
    cands = [
        Candidate(_slot("a-lemon", domain="nvl-a"), excluded=True),
        Candidate(_slot("b-small", memory_mb=40_000)),
        Candidate(_slot("c-a100", model="A100")),
        Candidate(_slot("d-ok")),
    ]
    picked = pick_spare(cands, request, NEAR)
    assert picked is not None
    assert picked[0].slot_id == "d-ok"
    assert pick_spare(cands[:3], request, NEAR) is None


def test_within_a_tier_a_slot_off_the_failed_node_comes_first() -> None:
    slots = [_slot("a", node="failed", domain="nvl-a"), _slot("b", node="n2", domain="nvl-a")]
    assert _pick(slots) == "b"
    assert _pick(slots[:1]) == "a"  # still better than nothing


def test_unknown_near_node_falls_back_to_any_in_slot_id_order() -> None:
    request = ReserveRequest(job_id="j1", cluster="c1", near_node="nowhere")
    picked = pick_spare([Candidate(_slot("b")), Candidate(_slot("a"))], request, None)
    assert picked is not None
    assert picked == (_slot("a"), "any")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["nvl-a", "nvl-b"]),
            st.sampled_from(["rack-1", "r2"]),
            st.sampled_from(["z1", "z2"]),
            st.booleans(),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_pick_is_never_worse_than_any_other_candidate(
    layout: list[tuple[str, str, str, bool]],
) -> None:
    slots = [
        _slot(f"s{i:02d}", node="failed" if on_failed else f"n{i}", domain=d, rack=r, zone=z)
        for i, (d, r, z, on_failed) in enumerate(layout)
    ]
    request = ReserveRequest(job_id="j1", cluster="c1", near_node="failed")
    picked = pick_spare([Candidate(s) for s in slots], request, NEAR)
    assert picked is not None

    def rank(s: SpareSlot) -> int:
        if s.nvlink_domain == NEAR.nvlink_domain:
            return 1
        if s.rack == NEAR.rack:
            return 2
        return 3 if s.zone == NEAR.zone else 4

    assert rank(picked[0]) == min(rank(s) for s in slots)


def test_reserve_request_validation_names_the_field() -> None:
    with pytest.raises(ValidationError, match="job_id"):
        ReserveRequest.model_validate({"cluster": "c1"})
    with pytest.raises(ValidationError, match="lease_s"):
        ReserveRequest.model_validate({"job_id": "j", "lease_s": 0})
    with pytest.raises(ValidationError, match="job_id"):
        ReserveRequest.model_validate({"job_id": "bad job id"})
    assert ReserveRequest(job_id="j").lease_s == 30.0


def test_registration_rules() -> None:
    assert registration_problem(_slot("c1:n:0")) is None
    assert registration_problem(_slot("x", state=SpareState.HOT))[0] == "job_id"  # type: ignore[index]
    assert registration_problem(_slot("x", state=SpareState.RESERVED))[0] == "state"  # type: ignore[index]
    assert registration_problem(_slot("x", job_id="j"))[0] == "job_id"  # type: ignore[index]
    assert registration_problem(_slot("has space"))[0] == "slot_id"  # type: ignore[index]


def test_register_over_an_existing_slot() -> None:
    idle = _slot("s")
    hot_j1 = _slot("s", state=SpareState.HOT, job_id="j1")
    assert register_conflict(idle, hot_j1) is None  # the launcher takes an idle slot
    assert register_conflict(hot_j1, hot_j1) is None  # a retry
    assert "hot spare of job j1" in (register_conflict(hot_j1, _slot("s")) or "")
    assert register_conflict(hot_j1, _slot("s", state=SpareState.HOT, job_id="j2"))
    leased = _slot("s", state=SpareState.RESERVED, job_id="j3")
    assert "release its lease" in (register_conflict(leased, idle) or "")
    assert register_conflict(idle, _slot("s", node="elsewhere"))


def test_floors_parse_and_resolve() -> None:
    assert parse_floors("") == {}
    assert parse_floors("2") == {"*": 2}
    floors = parse_floors("*=1, nvl-a=3 ,c1/nvl-a=4")
    assert floor_for(floors, "c1", "nvl-a") == 4
    assert floor_for(floors, "c2", "nvl-a") == 3
    assert floor_for(floors, "c2", "nvl-b") == 1
    assert floor_for({}, "c2", "nvl-b") == 0
    with pytest.raises(ValueError, match="TORCHRELAY_SPARE_FLOOR"):
        parse_floors("nvl-a=many")
    with pytest.raises(ValueError, match="TORCHRELAY_SPARE_FLOOR"):
        parse_floors("nvl-a=-1")


def test_pool_low_fires_once_per_episode() -> None:
    assert pool_low_change(available=1, floor=2, was_low=False) == "low"
    assert pool_low_change(available=0, floor=2, was_low=True) is None
    assert pool_low_change(available=2, floor=2, was_low=True) == "recovered"
    assert pool_low_change(available=0, floor=0, was_low=False) is None  # disabled


def test_public_surface_is_pinned() -> None:
    import services.spare_pool as pool

    assert sorted(pool.__all__) == [
        "Lease",
        "LeaseEnd",
        "ReserveRequest",
        "SlotView",
        "SpareInventory",
        "SparePool",
        "SparePoolSettings",
        "Topology",
        "pick_spare",
        "setup",
    ]
    assert all(hasattr(pool, name) for name in pool.__all__)


# --------------------------------------------------------------------------- re-admission


def _beat(job: str = "j1", rank: int | None = None, generation: int = 0) -> Heartbeat:
    return Heartbeat(
        event_id="hb-1",
        source="agent",
        job_id=job,
        member_id="j1-s0",
        rank=rank,
        generation=generation,
        step=-1,
        kind="liveness",
        node="n1",
        gpu=0,
        pid=1,
    )


def _generation(members: list[str]) -> Generation:
    return Generation(
        job_id="j1",
        generation=3,
        world_size=len(members),
        ranks=[
            RankAssignment(rank=i, member_id=m, node="n0", gpu=i) for i, m in enumerate(members)
        ],
        store_member=members[0],
        store_addr="127.0.0.1:1",
    )


KEPT = _slot("c1:n1:0", "n1", state=SpareState.HOT, job_id="j1")


def test_a_lapsed_spare_that_still_waits_as_its_jobs_spare_comes_back() -> None:
    assert readmission_problem(_beat(), KEPT, _generation(["j1-w0", "j1-w1"])) is None
    assert readmission_problem(_beat(), KEPT, None) is None  # the job has not formed yet


@pytest.mark.parametrize(
    ("beat", "kept", "generation", "named"),
    [
        (_beat(), None, None, "no registration is kept"),
        (_beat(job="j2"), KEPT, None, "beats for job j2 but was a spare of job j1"),
        (_beat(rank=1, generation=3), KEPT, None, "holds rank 1 in generation 3"),
        (_beat(), KEPT, _generation(["j1-w0", "j1-s0"]), "generation 3 of job j1 names it"),
    ],
)
def test_a_lapsed_spare_stays_out_unless_it_is_still_a_waiting_spare_of_its_job(
    beat: Heartbeat, kept: SpareSlot | None, generation: Generation | None, named: str
) -> None:
    problem = readmission_problem(beat, kept, generation)
    assert problem is not None
    assert named in problem
