"""Property tests of the inventory against a real Redis (hypothesis).

Random sequences of register / reserve / confirm / release / expire / quarantine / return /
heartbeat / job-finished keep every slot in exactly one state with consistent indexes, and
never hand one slot to two live leases. The Lua reservation picks what the pure reference
``rules.pick_spare`` picks.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.spare_pool.inventory import SpareInventory
from services.spare_pool.rules import Candidate, ReserveRequest, Topology, pick_spare
from torchrelay.bus import Conflict, NotFound
from torchrelay.contract import SpareSlot, SpareState

NODES = ["n0", "n1", "n2", "n3"]
JOBS = ["j1", "j2"]
TOPOLOGY = {  # node -> (nvlink_domain, rack, zone)
    "n0": ("nvl-0", "rack-0", "z0"),
    "n1": ("nvl-0", "rack-0", "z0"),
    "n2": ("nvl-1", "rack-0", "z0"),
    "n3": ("nvl-2", "rack-1", "z1"),
}
PROPERTY_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def _slot(
    node: str, gpu: int, *, hot_job: str | None = None, model: str = "H100", memory_mb: int = 80_000
) -> SpareSlot:
    domain, rack, zone = TOPOLOGY[node]
    return SpareSlot(
        slot_id=f"c1:{node}:{gpu}",
        cluster="c1",
        node=node,
        gpu=gpu,
        gpu_model=model,
        memory_mb=memory_mb,
        nvlink_domain=domain,
        rack=rack,
        zone=zone,
        state=SpareState.HOT if hot_job else SpareState.IDLE,
        job_id=hot_job,
        member_id=f"{hot_job}-{node}-{gpu}" if hot_job else None,
    )


node_st = st.sampled_from(NODES)
gpu_st = st.integers(0, 2)
job_st = st.sampled_from(JOBS)
op_st = st.one_of(
    st.tuples(st.just("register"), node_st, gpu_st, st.one_of(st.none(), job_st)),
    st.tuples(
        st.just("reserve"), job_st, st.one_of(st.none(), node_st), st.sampled_from([1.0, 5.0, 30.0])
    ),
    st.tuples(st.just("confirm"), st.integers(0, 20)),
    st.tuples(st.just("release"), st.integers(0, 20)),
    st.tuples(st.just("expire"), st.sampled_from([0.5, 2.0, 6.0, 40.0])),
    st.tuples(st.just("quarantine"), node_st, st.one_of(st.none(), gpu_st), st.booleans()),
    st.tuples(st.just("return"), node_st),
    st.tuples(st.just("heartbeat"), node_st, gpu_st, job_st),
    st.tuples(st.just("job_finished"), job_st),
)


async def _lease_state(redis: aioredis.Redis, prefix: str, lease_id: str) -> str | None:
    raw = await redis.hget(f"{prefix}:lease:{lease_id}", "state")
    return raw.decode() if isinstance(raw, bytes) else raw


@PROPERTY_SETTINGS
@given(ops=st.lists(op_st, min_size=1, max_size=30))
async def test_random_sequences_keep_each_slot_in_exactly_one_state(
    redis: aioredis.Redis, ops: list[tuple[Any, ...]]
) -> None:
    prefix = f"tr:spare_pool:prop:{uuid.uuid4().hex[:8]}"
    clock = Clock()
    inv = SpareInventory(redis, prefix, clock=clock, heartbeat_grace_s=30)
    leases: list[str] = []
    holder: dict[str, str] = {}  # slot_id -> the last lease that was handed it
    for op in ops:
        kind = op[0]
        if kind == "register":
            _, node, gpu, hot_job = op
            # A hot spare of another job, or a leased slot, is refused and nothing changes.
            with contextlib.suppress(Conflict):
                await inv.register(_slot(node, gpu, hot_job=hot_job))
        elif kind == "reserve":
            _, job, near, lease_s = op
            outcome = await inv.reserve(
                ReserveRequest(job_id=job, cluster="c1", near_node=near, lease_s=lease_s)
            )
            if outcome.lease is not None:
                slot_id = outcome.lease.slot.slot.slot_id
                previous = holder.get(slot_id)
                if previous is not None:
                    # Never handed out twice: the earlier lease on this slot has ended.
                    assert await _lease_state(redis, prefix, previous) not in (
                        "active",
                        "confirmed",
                    )
                holder[slot_id] = outcome.lease.lease_id
                leases.append(outcome.lease.lease_id)
            else:
                assert isinstance(outcome.error, NotFound)
        elif kind in ("confirm", "release") and leases:
            lease_id = leases[op[1] % len(leases)]
            if kind == "confirm":
                view, _, error = await inv.confirm(lease_id)
                assert (view is None) == (error is not None)
                if view is not None:
                    assert view.slot.state is SpareState.IN_USE
            else:
                await inv.release(lease_id, "test")
                assert await _lease_state(redis, prefix, lease_id) not in ("active", "confirmed")
        elif kind == "expire":
            clock.now += op[1]
            await inv.sweep()
            due = await redis.zrangebyscore(f"{prefix}:leases", "-inf", int(clock.now * 1000))
            assert due == []
        elif kind == "quarantine":
            _, node, gpu, rma = op
            await inv.quarantine(node, gpu=gpu, cluster="c1", reason="test", rma=rma)
            for view in (await inv.list_slots(limit=1000))[0]:
                if view.slot.node == node and (gpu is None or view.slot.gpu == gpu):
                    assert view.slot.state in (SpareState.QUARANTINED, SpareState.RMA)
        elif kind == "return":
            with contextlib.suppress(NotFound):
                await inv.return_to_service(op[1], gpu=None, cluster="c1", reason="test")
        elif kind == "heartbeat":
            _, node, gpu, job = op
            await inv.heartbeat(f"{job}-{node}-{gpu}", timeout_s=10)
        elif kind == "job_finished":
            await inv.job_finished(op[1], "test")
            for view in (await inv.list_slots(limit=1000))[0]:
                if view.slot.state in (SpareState.HOT, SpareState.RESERVED, SpareState.IN_USE):
                    assert view.slot.job_id != op[1]
        assert await inv.audit() == [], op
    # Every slot in the pool is in exactly one state, and the states add up.
    views, _ = await inv.list_slots(limit=1000)
    by_state = {
        s.value: len((await inv.list_slots(state=s.value, limit=1000))[0]) for s in SpareState
    }
    assert sum(by_state.values()) == len(views)


@PROPERTY_SETTINGS
@given(
    layout=st.lists(
        st.tuples(
            node_st,
            gpu_st,
            st.one_of(st.none(), job_st),
            st.sampled_from(["H100", "A100"]),
            st.sampled_from([40_000, 80_000]),
        ),
        min_size=1,
        max_size=12,
        unique_by=lambda t: (t[0], t[1]),
    ),
    lemons=st.sets(node_st, max_size=2),
    job=job_st,
    near=st.one_of(st.none(), node_st, st.just("unknown-node")),
    model=st.one_of(st.none(), st.just("H100")),
    min_memory=st.sampled_from([0, 80_000]),
)
async def test_the_lua_reservation_picks_what_the_reference_rules_pick(
    redis: aioredis.Redis,
    layout: list[tuple[str, int, str | None, str, int]],
    lemons: set[str],
    job: str,
    near: str | None,
    model: str | None,
    min_memory: int,
) -> None:
    inv = SpareInventory(redis, f"tr:spare_pool:ref:{uuid.uuid4().hex[:8]}", clock=Clock())
    for node, gpu, hot_job, gpu_model, memory in layout:
        await inv.register(_slot(node, gpu, hot_job=hot_job, model=gpu_model, memory_mb=memory))
    for node in lemons:
        await inv.set_health("c1", node, None, "lemon")
    request = ReserveRequest(
        job_id=job, cluster="c1", near_node=near, gpu_model=model, min_memory_mb=min_memory
    )
    registered_nodes = {n for n, *_ in layout}
    near_topology = Topology(*TOPOLOGY[near]) if near in registered_nodes else None
    # Reserve until nothing fits; each pick must match the reference on what is left.
    for _ in range(len(layout) + 1):
        views, _ = await inv.list_slots(limit=1000)
        candidates = [Candidate(v.slot, excluded=v.slot.node in lemons) for v in views]
        expected = pick_spare(candidates, request, near_topology)
        outcome = await inv.reserve(request)
        if expected is None:
            assert outcome.lease is None
            break
        assert outcome.lease is not None
        assert (outcome.lease.slot.slot.slot_id, outcome.lease.tier) == (
            expected[0].slot_id,
            expected[1],
        )
