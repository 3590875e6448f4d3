"""Leader election among replicas on a real Redis (torchrelay.leadership)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from torchrelay.leadership import FencedRedis, LeaderLease, LeaseClock, LeaseLost


class Clock:
    """A local clock the test moves by hand (a replica paused, then woken)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def test_one_replica_leads_and_a_standby_takes_over_when_it_lapses(
    redis: aioredis.Redis,
) -> None:
    clock = LeaseClock(ttl_s=0.3)
    a = LeaderLease(redis, "tr:svc:leader", clock)
    b = LeaderLease(redis, "tr:svc:leader", clock)
    assert await a.try_acquire()
    assert not await b.try_acquire()
    a.check()
    with pytest.raises(LeaseLost):
        b.check()
    # Renewed, it outlives its TTL; left alone it lapses and b takes it.
    for _ in range(3):
        await asyncio.sleep(0.15)
        assert await a.renew()
    assert not await b.try_acquire()
    await asyncio.wait_for(b.acquire(poll_s=0.05), 2.0)
    b.check()
    # a's own clock says it lapsed before b could take it; and a renewal is refused now.
    with pytest.raises(LeaseLost):
        a.check()
    with pytest.raises(LeaseLost):
        await a.renew()


async def fenced_leader(redis: aioredis.Redis) -> tuple[Clock, LeaderLease, FencedRedis]:
    """A leader on a hand-moved clock, and a client fenced by its lease."""
    now = Clock()
    lease = LeaderLease(redis, "tr:svc:leader", LeaseClock(ttl_s=5.0), now=now)
    assert await lease.try_acquire()
    fenced = FencedRedis(connection_pool=redis.connection_pool)
    fenced.fence = lease.check
    return now, lease, fenced


async def test_a_leader_paused_past_its_deadline_acts_on_nothing_when_it_wakes(
    redis: aioredis.Redis,
) -> None:
    now, lease, fenced = await fenced_leader(redis)
    await fenced.set("tr:svc:x", "before")
    now.t += 20.0  # SIGSTOP for 20 s: the monotonic clock went on
    with pytest.raises(LeaseLost, match="lapsed"):
        await fenced.set("tr:svc:x", "stale")
    with pytest.raises(LeaseLost):
        fenced.pipeline()
    assert await redis.get("tr:svc:x") == b"before"
    # It stays lost even if Redis would still extend the key for it.
    with pytest.raises(LeaseLost):
        await lease.renew()


async def test_a_pipeline_checks_the_fence_when_it_executes(redis: aioredis.Redis) -> None:
    now, _, fenced = await fenced_leader(redis)
    pipe = fenced.pipeline()
    pipe.set("tr:svc:y", "stale")
    now.t += 6.0
    with pytest.raises(LeaseLost):
        await pipe.execute()
    assert await redis.get("tr:svc:y") is None


async def test_keep_reports_the_loss_and_release_hands_over_at_once(
    redis: aioredis.Redis,
) -> None:
    clock = LeaseClock(ttl_s=0.4)
    a = LeaderLease(redis, "tr:svc:leader", clock)
    b = LeaderLease(redis, "tr:svc:leader", clock)
    assert await a.try_acquire()
    lost: list[str] = []
    keeper = asyncio.ensure_future(a.keep(lost.append))
    await asyncio.sleep(0.5)  # renewed past its TTL
    assert not lost
    assert a.held
    # Another replica overwrites the key (an operator, a split brain): a notices and stops.
    await redis.set("tr:svc:leader", b.owner, px=400)
    await asyncio.wait_for(keeper, 2.0)
    assert lost
    assert "another replica" in lost[0]
    await redis.delete("tr:svc:leader")
    assert await a.try_acquire()
    await a.release()
    assert await b.try_acquire()  # no TTL to wait out after a clean stop
