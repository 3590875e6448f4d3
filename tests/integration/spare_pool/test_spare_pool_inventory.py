"""The spare inventory against a real Redis: atomic leases, expiry, locality, exclusions."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
import redis.asyncio as aioredis

from services.spare_pool.inventory import LAPSED_KEEP_S, SpareInventory
from services.spare_pool.rules import ReserveRequest
from torchrelay.bus import Conflict, NotFound
from torchrelay.contract import SpareSlot, SpareState

PREFIX = "tr:spare_pool"


class Clock:
    """A clock the test moves by hand, so expiry needs no sleeping."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def inv(redis: aioredis.Redis, clock: Clock) -> SpareInventory:
    return SpareInventory(redis, PREFIX, clock=clock, heartbeat_grace_s=30)


def spare(
    node: str,
    gpu: int = 0,
    *,
    domain: str | None = None,
    rack: str = "rack-9",
    zone: str = "z9",
    model: str = "H100",
    memory_mb: int = 80_000,
    state: str = "idle",
    job_id: str | None = None,
    member_id: str | None = None,
    cluster: str = "c1",
) -> SpareSlot:
    return SpareSlot(
        slot_id=f"{cluster}:{node}:{gpu}",
        cluster=cluster,
        node=node,
        gpu=gpu,
        gpu_model=model,
        memory_mb=memory_mb,
        nvlink_domain=domain or f"nvl-{node}",
        rack=rack,
        zone=zone,
        state=SpareState(state),
        job_id=job_id,
        member_id=member_id,
    )


def want(job: str = "j1", **kw: object) -> ReserveRequest:
    return ReserveRequest.model_validate({"job_id": job, "cluster": "c1", **kw})


async def test_200_concurrent_reservations_over_50_spares_give_exactly_50_leases(
    inv: SpareInventory, redis_url: str
) -> None:
    for i in range(50):
        await inv.register(spare(f"n{i // 8}", i % 8))
    # Ten independent clients (as ten executors or pool replicas would be), 20 requests each,
    # all in flight at once.
    clients = [aioredis.from_url(redis_url) for _ in range(10)]
    try:
        pools = [SpareInventory(c, PREFIX) for c in clients]
        outcomes = await asyncio.gather(
            *(pools[k % 10].reserve(want(f"job{k}")) for k in range(200))
        )
    finally:
        for c in clients:
            await c.aclose()
    leases = [o.lease for o in outcomes if o.lease is not None]
    refused = [o.error for o in outcomes if o.lease is None]
    assert len(leases) == 50
    assert len({lease.slot.slot.slot_id for lease in leases}) == 50
    assert len({lease.lease_id for lease in leases}) == 50
    assert all(isinstance(e, NotFound) for e in refused)
    assert len(refused) == 150
    assert await inv.audit() == []
    listed, _ = await inv.list_slots(state="reserved", limit=100)
    assert len(listed) == 50


async def test_an_unconfirmed_lease_expires_and_the_spare_comes_back(
    inv: SpareInventory, clock: Clock
) -> None:
    await inv.register(spare("n1"))
    first = (await inv.reserve(want("j1", lease_s=5))).lease
    assert first is not None
    assert (await inv.reserve(want("j2"))).lease is None  # held while the lease runs
    clock.advance(5.001)
    swept = await inv.sweep()
    assert [e.lease_id for e in swept.expired] == [first.lease_id]
    slot = await inv.get_slot("c1:n1:0")
    assert slot is not None
    assert slot.slot.state is SpareState.IDLE
    assert slot.slot.job_id is None
    # The late client cannot confirm the lease it lost.
    _, _, error = await inv.confirm(first.lease_id)
    assert isinstance(error, Conflict)
    assert "expired" in str(error)
    second = (await inv.reserve(want("j2"))).lease
    assert second is not None
    assert second.slot.slot.slot_id == "c1:n1:0"
    history = [(h["from"], h["to"]) for h in await inv.history("c1:n1:0")]
    assert history == [
        ("new", "idle"),
        ("idle", "reserved"),
        ("reserved", "idle"),
        ("idle", "reserved"),
    ]


async def test_the_reservation_itself_reclaims_an_expired_lease_without_the_sweeper(
    inv: SpareInventory, clock: Clock
) -> None:
    await inv.register(spare("n1"))
    first = (await inv.reserve(want("j1", lease_s=2))).lease
    assert first is not None
    clock.advance(3)
    outcome = await inv.reserve(want("j2"))
    assert outcome.lease is not None
    assert [e.lease_id for e in outcome.expired] == [first.lease_id]


async def test_confirm_release_and_hot_spares_stay_hot_for_their_job(
    inv: SpareInventory,
) -> None:
    await inv.register(spare("n1", state="hot", job_id="j1", member_id="j1-s0"))
    await inv.register(spare("n2"))
    # Another job never gets j1's hot spare.
    other = (await inv.reserve(want("j2"))).lease
    assert other is not None
    assert other.slot.slot.node == "n2"
    hot = (await inv.reserve(want("j1"))).lease
    assert hot is not None
    assert hot.tier == "hot"
    assert hot.slot.slot.member_id == "j1-s0"
    view, _, _ = await inv.release(hot.lease_id, "migration failed")
    assert view is not None
    assert view.slot.state is SpareState.HOT
    assert view.slot.job_id == "j1"
    again, ended, outcome = await inv.release(hot.lease_id, "twice")  # idempotent
    assert ended is None
    assert outcome == "released"
    assert again is not None
    view2, _, _ = await inv.release(other.lease_id, "done")
    assert view2 is not None
    assert view2.slot.state is SpareState.IDLE
    assert view2.slot.job_id is None
    used = (await inv.reserve(want("j1"))).lease
    assert used is not None
    confirmed, _, err = await inv.confirm(used.lease_id)
    assert err is None
    assert confirmed is not None
    assert confirmed.slot.state is SpareState.IN_USE
    with pytest.raises(NotFound, match="no lease nope") as missing:
        await inv.release("nope", "x")
    assert missing.value.field == "lease_id"
    assert await inv.audit() == []


async def test_locality_order_holds(inv: SpareInventory) -> None:
    # The failed node sits in nvl-a / rack-1 / z1; it has a (now idle) slot of its own.
    await inv.register(spare("failed", 7, domain="nvl-a", rack="rack-1", zone="z1"))
    await inv.register(spare("any", domain="nvl-z", rack="rack-z", zone="zz"))
    await inv.register(spare("zone", domain="nvl-y", rack="rack-y", zone="z1"))
    await inv.register(spare("rack", domain="nvl-x", rack="rack-1", zone="z1"))
    await inv.register(spare("domain", domain="nvl-a", rack="rack-1", zone="z1"))
    await inv.register(spare("hot", domain="nvl-q", state="hot", job_id="j1", member_id="m1"))
    await inv.register(spare("other-hot", domain="nvl-a", state="hot", job_id="j9", member_id="m9"))
    order = []
    for _ in range(6):
        lease = (await inv.reserve(want("j1", near_node="failed"))).lease
        assert lease is not None
        order.append((lease.slot.slot.node, lease.tier))
    assert order == [
        ("hot", "hot"),
        ("domain", "nvlink_domain"),
        ("failed", "nvlink_domain"),
        ("rack", "rack"),
        ("zone", "zone"),
        ("any", "any"),
    ]
    assert (await inv.reserve(want("j1", near_node="failed"))).lease is None


async def test_quarantined_and_lemon_nodes_are_never_handed_out(inv: SpareInventory) -> None:
    for node in ("bad", "lemon", "good"):
        for gpu in range(2):
            await inv.register(spare(node, gpu))
    q = await inv.quarantine("bad", gpu=None, cluster="c1", reason="xid 79", rma=False)
    assert sorted(q.changed) == ["c1:bad:0", "c1:bad:1"]
    await inv.set_health("c1", "lemon", None, "lemon")
    got = []
    while (lease := (await inv.reserve(want())).lease) is not None:
        got.append(lease.slot.slot.node)
    assert got == ["good", "good"]
    # A slot registered later on the quarantined node starts quarantined.
    view, _ = await inv.register(spare("bad", 5))
    assert view.slot.state is SpareState.QUARANTINED
    assert "excluded" in view.reason
    depth = {(d.nvlink_domain): d.available for d in await inv.depth("c1")}
    assert depth == {"nvl-bad": 0, "nvl-lemon": 0, "nvl-good": 0}
    # Back to service: the node is idle again and reservable; the lemon stays out.
    returned = await inv.return_to_service("bad", gpu=None, cluster="c1", reason="repaired")
    assert len(returned) == 3
    lease = (await inv.reserve(want())).lease
    assert lease is not None
    assert lease.slot.slot.node == "bad"
    await inv.set_health("c1", "lemon", None, "healthy")
    assert {d.nvlink_domain: d.available for d in await inv.depth("c1")}["nvl-lemon"] == 2
    assert await inv.audit() == []


async def test_quarantine_revokes_a_lease_and_confirm_is_refused(inv: SpareInventory) -> None:
    await inv.register(spare("n1"))
    lease = (await inv.reserve(want())).lease
    assert lease is not None
    q = await inv.quarantine("n1", gpu=0, cluster=None, reason="ecc", rma=True)
    assert [e.lease_id for e in q.revoked] == [lease.lease_id]
    assert q.slots[0].slot.state is SpareState.RMA
    _, _, err = await inv.confirm(lease.lease_id)
    assert isinstance(err, Conflict)
    assert "revoked" in str(err)
    await inv.quarantine("n1", gpu=None, cluster=None, reason="all", rma=False)
    with pytest.raises(Conflict, match="without gpu"):
        await inv.return_to_service("n1", gpu=0, cluster=None, reason="x")
    assert await inv.audit() == []


async def test_unknown_node_and_misfits_name_the_problem(inv: SpareInventory) -> None:
    await inv.register(spare("n1", model="A100", memory_mb=40_000))
    with pytest.raises(NotFound, match="node ghost"):
        await inv.return_to_service("ghost", gpu=None, cluster=None, reason="x")
    q = await inv.quarantine("ghost", gpu=None, cluster="c1", reason="x", rma=False)
    assert not q.known
    # ... but it is remembered: a slot registered there later is quarantined.
    view, _ = await inv.register(spare("ghost"))
    assert view.slot.state is SpareState.QUARANTINED
    model = await inv.reserve(want(gpu_model="H100"))
    assert isinstance(model.error, NotFound)
    assert model.error.field == "gpu_model"
    assert "A100" in str(model.error)
    memory = await inv.reserve(want(min_memory_mb=80_000))
    assert isinstance(memory.error, NotFound)
    assert memory.error.field == "min_memory_mb"
    empty = await inv.reserve(want(cluster="c2"))
    assert isinstance(empty.error, NotFound)
    assert empty.error.field == "cluster"


async def test_a_retried_reservation_gets_the_same_lease(inv: SpareInventory) -> None:
    await inv.register(spare("n1"))
    await inv.register(spare("n2"))
    a = (await inv.reserve(want(request_id="mig-1"))).lease
    b = (await inv.reserve(want(request_id="mig-1"))).lease
    assert a is not None
    assert b is not None
    assert b.replayed
    assert (a.lease_id, a.slot.slot.slot_id) == (b.lease_id, b.slot.slot.slot_id)


async def test_a_silent_hot_spare_leaves_the_pool_and_a_beating_one_stays(
    inv: SpareInventory, clock: Clock
) -> None:
    await inv.register(spare("n1", state="hot", job_id="j1", member_id="j1-s0"))
    await inv.register(spare("n2", state="hot", job_id="j1", member_id="j1-s1"))
    for _ in range(2):
        clock.advance(10)
        assert await inv.heartbeat("j1-s0", timeout_s=15)
        assert (await inv.sweep()).removed == []
    clock.advance(15)  # 35 s since registration: past the 30 s grace for the silent j1-s1
    assert await inv.heartbeat("j1-s0", timeout_s=15)
    swept = await inv.sweep()
    assert [r["member_id"] for r in swept.removed] == ["j1-s1"]
    assert await inv.get_slot("c1:n2:0") is None
    assert (await inv.history("c1:n2:0"))[-1]["to"] == "removed"
    assert not await inv.heartbeat("stranger", timeout_s=15)
    clock.advance(16)
    assert [r["member_id"] for r in (await inv.sweep()).removed] == ["j1-s0"]


async def test_the_sweep_keeps_a_removed_spares_registration_until_taken_or_too_old(
    inv: SpareInventory, clock: Clock
) -> None:
    await inv.register(spare("n1", state="hot", job_id="j1", member_id="j1-s0"))
    await inv.register(spare("n2", state="hot", job_id="j2", member_id="j2-s0"))
    await inv.register(spare("n3", state="hot", job_id="j1", member_id="j1-s1"))
    reserved = (await inv.reserve(want("j1", near_node="n9", lease_s=300))).lease
    assert reserved is not None
    clock.advance(31)
    assert len((await inv.sweep()).removed) == 3
    assert await inv.lapsed_members() == {"j1-s0", "j2-s0", "j1-s1"}
    # What comes back is the slot as registered: a hot spare of its job, no lease.
    kept = {m: await inv.lapsed(m) for m in ("j1-s0", "j1-s1")}
    for member, slot in kept.items():
        assert slot is not None
        assert (slot.state, slot.job_id, slot.member_id) == (SpareState.HOT, "j1", member)
    assert {s.node for s in kept.values() if s is not None} == {"n1", "n3"}
    for member in kept:
        await inv.forget_lapsed_member(member)
        assert await inv.lapsed(member) is None
    assert await inv.lapsed_members() == {"j2-s0"}
    assert await inv.forget_lapsed("j1") == []
    await inv.register(spare("n4", state="hot", job_id="j2", member_id="j2-s1"))
    clock.advance(31)
    await inv.sweep()
    assert await inv.forget_lapsed("j2") in (["j2-s0", "j2-s1"], ["j2-s1", "j2-s0"])
    assert await inv.lapsed_members() == set()
    # Never re-admitted nor forgotten: dropped after LAPSED_KEEP_S.
    await inv.register(spare("n5", state="hot", job_id="j3", member_id="j3-s0"))
    clock.advance(31)
    await inv.sweep()
    clock.advance(LAPSED_KEEP_S - 1)
    await inv.sweep()
    assert await inv.lapsed_members() == {"j3-s0"}
    clock.advance(2)
    await inv.sweep()
    assert await inv.lapsed_members() == set()
    assert await inv.lapsed("j3-s0") is None


async def test_an_unreadable_kept_registration_is_dropped_not_retried(
    inv: SpareInventory, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    await inv.register(spare("n1", state="hot", job_id="j1", member_id="j1-s0"))
    await inv.register(spare("n2", state="hot", job_id="j2", member_id="j2-s0"))
    clock.advance(31)
    assert len((await inv.sweep()).removed) == 2
    key = inv.key("lapsed_reg")
    await inv.redis.hset(key, "j1-s0", b"{not json")
    await inv.redis.hset(key, "j2-s0", json.dumps({"slot_id": "c1:n2:0"}))  # no node, no gpu
    await inv.redis.hset(key, "j9-s0", json.dumps(["a", "list"]))
    with caplog.at_level(logging.WARNING, logger="services.spare_pool.inventory"):
        assert await inv.lapsed("j1-s0") is None
    assert "j1-s0" in caplog.text
    assert await inv.lapsed_members() == {"j2-s0", "j9-s0"}
    # The job's end drops the unreadable entries of every job, returning only its own.
    assert await inv.forget_lapsed("j7") == []
    assert await inv.lapsed_members() == set()
    assert await inv.redis.hlen(key) == 0


async def test_after_its_first_beat_a_spare_gets_the_timeout_not_the_grace(
    inv: SpareInventory, clock: Clock
) -> None:
    await inv.register(spare("n1", state="hot", job_id="j1", member_id="j1-s0"))
    clock.advance(1)
    assert await inv.heartbeat("j1-s0", timeout_s=5)
    clock.advance(4)
    assert (await inv.sweep()).removed == []
    clock.advance(2)  # 6 s after its only beat, long before the 30 s grace would end
    assert [r["member_id"] for r in (await inv.sweep()).removed] == ["j1-s0"]


async def test_a_finished_job_lets_its_spares_go(inv: SpareInventory) -> None:
    await inv.register(spare("n1", state="hot", job_id="j1", member_id="j1-s0"))
    await inv.register(spare("n2", state="hot", job_id="j1", member_id="j1-s1"))
    await inv.register(spare("n3"))
    for _ in range(3):
        lease = (await inv.reserve(want("j1"))).lease
        assert lease is not None
        if lease.slot.slot.node != "n2":
            await inv.confirm(lease.lease_id)
    done = await inv.job_finished("j1", "job j1 finished (succeeded)")
    assert sorted(done.removed) == ["c1:n1:0", "c1:n2:0"]
    assert done.freed == ["c1:n3:0"]
    assert len(done.ended) == 3
    slot = await inv.get_slot("c1:n3:0")
    assert slot is not None
    assert slot.slot.state is SpareState.IDLE
    assert await inv.audit() == []


async def test_registration_conflicts(inv: SpareInventory) -> None:
    await inv.register(spare("n1", state="hot", job_id="j1", member_id="j1-s0"))
    with pytest.raises(Conflict, match="hot spare of job j1"):
        await inv.register(spare("n1"))
    # A retry of the same registration is harmless.
    view, previous = await inv.register(spare("n1", state="hot", job_id="j1", member_id="j1-s0"))
    assert previous == "hot"
    assert view.slot.state is SpareState.HOT


async def test_list_pages_with_a_cursor(inv: SpareInventory) -> None:
    for i in range(7):
        await inv.register(spare(f"n{i}", cluster="c1" if i % 2 else "c2"))
    seen: list[str] = []
    cursor = None
    while True:
        items, cursor = await inv.list_slots(cluster="c1", limit=2, cursor=cursor)
        seen += [v.slot.slot_id for v in items]
        if cursor is None:
            break
    assert seen == ["c1:n1:0", "c1:n3:0", "c1:n5:0"]
