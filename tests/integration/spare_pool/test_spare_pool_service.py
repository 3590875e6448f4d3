"""The spare-pool service in-process on real NATS and Redis: its RPC verbs, events and sweeper."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from nats.aio.msg import Msg

from services.spare_pool.service import SparePoolSettings, setup
from tests.helpers.inproc import InProcess, service_settings, start_in_process
from torchrelay.bus import Bus, RpcFailed
from torchrelay.contract import (
    Generation,
    Heartbeat,
    JobFinished,
    NodeHealth,
    NodeHealthChanged,
    RankAssignment,
    SparePoolLow,
    SpareQuarantined,
    SpareReleased,
    SpareSlot,
    Subjects,
    make_event_id,
)
from torchrelay.launcher import register_hot_spare

DEADLINE_S = 20.0


class Pool:
    """A running spare-pool service and a client bus to talk to it."""

    def __init__(self, bus: Bus, http_port: int) -> None:
        self.bus = bus
        self.http_port = http_port

    async def rpc(self, verb: str, body: dict[str, Any], timeout: float = 10.0) -> Any:
        return await self.bus.request(Subjects.rpc("spare_pool", verb), body, timeout=timeout)

    async def error(self, verb: str, body: dict[str, Any]) -> RpcFailed:
        with pytest.raises(RpcFailed) as caught:
            await self.rpc(verb, body)
        return caught.value

    async def metrics(self) -> str:
        def fetch() -> str:
            url = f"http://127.0.0.1:{self.http_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as resp:
                return str(resp.read().decode())

        return await asyncio.to_thread(fetch)


@pytest.fixture
async def start_pool(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus
) -> AsyncIterator[Callable[..., Awaitable[Pool]]]:
    """Start the service in this process with settings overrides; stopped at the end."""
    del redis  # flushed before the service starts; the bus fixture purged the streams
    started: list[InProcess] = []

    async def start(**overrides: Any) -> Pool:
        settings = service_settings(nats_url, redis_url, SparePoolSettings, **overrides)
        started.append(await start_in_process("spare_pool", setup, settings))
        return Pool(bus, started[-1].port)

    yield start
    for service in started:
        service.stop.set()
    for service in started:
        await service.stopped(within_s=30)


class EventTap:
    """Every event published on one subject since the stream was purged."""

    def __init__(self) -> None:
        self.payloads: list[dict[str, Any]] = []
        self._sub: Any = None

    @classmethod
    async def start(cls, bus: Bus, subject: str) -> EventTap:
        tap = cls()

        async def on_msg(msg: Msg) -> None:
            tap.payloads.append(json.loads(msg.data))

        tap._sub = await bus.js.subscribe(subject, cb=on_msg, ordered_consumer=True)
        return tap

    async def wait(
        self, what: str, predicate: Callable[[dict[str, Any]], bool] = bool, count: int = 1
    ) -> list[dict[str, Any]]:
        async def enough() -> list[dict[str, Any]] | None:
            found = [p for p in self.payloads if predicate(p)]
            return found if len(found) >= count else None

        found: list[dict[str, Any]] = await until(enough, what)
        return found


async def until(
    predicate: Callable[[], Awaitable[Any]], what: str, timeout: float = DEADLINE_S
) -> Any:
    """Poll until ``predicate`` returns something truthy; fail naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.05)


def slot_body(node: str, gpu: int = 0, **extra: Any) -> dict[str, Any]:
    body = {
        "cluster": "local",
        "node": node,
        "gpu": gpu,
        "gpu_model": "H100",
        "memory_mb": 80_000,
        "nvlink_domain": f"nvl-{node}",
        "rack": "rack-1",
        "zone": "z1",
    }
    body.update(extra)
    return body


async def test_200_concurrent_rpc_reservations_over_50_spares_give_exactly_50_leases(
    start_pool: Callable[..., Awaitable[Pool]], bus: Bus
) -> None:
    pool = await start_pool()
    reserved = await EventTap.start(bus, Subjects.SPARE_RESERVED)
    for i in range(50):
        await pool.rpc("register", slot_body(f"n{i // 8}", i % 8))

    async def reserve(k: int) -> dict[str, Any] | RpcFailed:
        try:
            result: dict[str, Any] = await pool.rpc(
                "reserve", {"job_id": f"job{k}", "cluster": "local"}, timeout=60
            )
            return result
        except RpcFailed as exc:
            return exc

    replies = await asyncio.gather(*(reserve(k) for k in range(200)))
    leases = [r for r in replies if isinstance(r, dict)]
    refused = [r for r in replies if isinstance(r, RpcFailed)]
    assert len(leases) == 50
    assert len({r["slot"]["slot_id"] for r in leases}) == 50
    assert len(refused) == 150
    assert {r.error.code for r in refused} == {"not_found"}
    assert "no spare fits" in refused[0].error.message
    page = await pool.rpc("list", {"state": "reserved", "limit": 1000})
    assert len(page["items"]) == 50
    events = await reserved.wait("50 SpareReserved events", count=50)
    assert {e["lease_id"] for e in events} == {r["lease_id"] for r in leases}
    assert all(e["event_id"] == make_event_id("spare_reserved", e["lease_id"]) for e in events)


_DOOMED_CLIENT = """
import asyncio, os, signal, sys
from torchrelay.bus import Bus
from torchrelay.contract import Subjects

async def main():
    bus = await Bus.connect(sys.argv[1], "doomed-executor")
    lease = await bus.request(Subjects.rpc("spare_pool", "reserve"),
                              {"job_id": "j1", "cluster": "local", "lease_s": 1.0}, timeout=10)
    print(lease["lease_id"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # dies before it can confirm

asyncio.run(main())
"""


async def test_a_client_that_dies_between_reserve_and_confirm_loses_no_spare(
    start_pool: Callable[..., Awaitable[Pool]], bus: Bus, nats_url: str
) -> None:
    pool = await start_pool(spare_sweep_interval_s=0.1)
    released = await EventTap.start(bus, Subjects.SPARE_RELEASED)
    await pool.rpc("register", slot_body("n1"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _DOOMED_CLIENT, nats_url, stdout=subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == -9
    lease_id = out.decode().strip()
    assert lease_id
    # The lease runs out unconfirmed: the sweeper gives the spare back by itself.
    events = await released.wait(
        "the dead client's lease to expire", lambda e: e["lease_id"] == lease_id
    )
    assert "expired" in events[0]["reason"]
    slot = await pool.rpc("get", {"slot_id": "local:n1:0"})
    assert slot["state"] == "idle"
    assert [h["to"] for h in slot["history"]] == ["idle", "reserved", "idle"]
    late = await pool.error("confirm", {"lease_id": lease_id})
    assert late.error.code == "conflict"
    again = await pool.rpc("reserve", {"job_id": "j2", "cluster": "local"})
    assert again["slot"]["slot_id"] == "local:n1:0"


async def test_errors_name_the_problem_and_the_service_keeps_serving(
    start_pool: Callable[..., Awaitable[Pool]], bus: Bus
) -> None:
    pool = await start_pool()
    await pool.rpc("register", slot_body("n1"))

    missing_job = await pool.error("reserve", {"cluster": "local"})
    assert (missing_job.error.code, missing_job.error.field) == ("invalid", "job_id")
    model = await pool.error("reserve", {"job_id": "j1", "cluster": "local", "gpu_model": "B200"})
    assert (model.error.code, model.error.field) == ("not_found", "gpu_model")
    assert "B200" in model.error.message
    assert "H100" in model.error.message
    unknown_slot = await pool.error("get", {"slot_id": "local:ghost:0"})
    assert (unknown_slot.error.code, unknown_slot.error.field) == ("not_found", "slot_id")
    unknown_node = await pool.error("quarantine", {"node": "ghost", "reason": "xid 79"})
    assert (unknown_node.error.code, unknown_node.error.field) == ("not_found", "node")
    assert "ghost" in unknown_node.error.message
    not_there = await pool.error("return", {"node": "nowhere"})
    assert (not_there.error.code, not_there.error.field) == ("not_found", "node")
    bad_state = await pool.error("register", slot_body("n2", state="in_use"))
    assert (bad_state.error.code, bad_state.error.field) == ("invalid", "state")
    no_node = await pool.error("register", {"gpu": 0})
    assert (no_node.error.code, no_node.error.field) == ("invalid", "node")
    no_lease = await pool.error("confirm", {"lease_id": "nope"})
    assert (no_lease.error.code, no_lease.error.field) == ("not_found", "lease_id")
    no_reason = await pool.error("quarantine", {"node": "n1"})
    assert (no_reason.error.code, no_reason.error.field) == ("invalid", "reason")
    garbage = await bus.nc.request(Subjects.rpc("spare_pool", "reserve"), b"{not json", timeout=10)
    reply = json.loads(garbage.data)
    assert not reply["ok"]
    assert "JSON" in reply["error"]["message"]
    # Still serving.
    lease = await pool.rpc("reserve", {"job_id": "j1", "cluster": "local"})
    assert lease["slot"]["slot_id"] == "local:n1:0"
    assert lease["tier"] == "any"


async def test_lemon_nodes_are_skipped_and_a_finished_job_lets_its_hot_spares_go(
    start_pool: Callable[..., Awaitable[Pool]], bus: Bus
) -> None:
    pool = await start_pool()
    await pool.rpc("register", slot_body("lemon"))
    await pool.rpc("register", slot_body("good", state="hot", job_id="j1", member_id="j1-s0"))
    await pool.rpc("register", slot_body("good", 1, state="hot", job_id="j1", member_id="j1-s1"))
    await bus.publish(
        NodeHealthChanged(
            event_id="health-lemon-1",
            source="detector",
            cluster="local",
            node="lemon",
            health=NodeHealth.LEMON,
            lemon_score=0.97,
            reason="3 faults in 24 h",
        ),
        Subjects.NODE_HEALTH,
    )

    async def lemon_marked() -> bool:
        slot = await pool.rpc("get", {"slot_id": "local:lemon:0"})
        return bool(slot["excluded_by"].get("health") == "lemon")

    await until(lemon_marked, "the detector's lemon verdict to reach the pool")
    refused = await pool.error("reserve", {"job_id": "j2", "cluster": "local"})
    assert refused.error.code == "not_found"
    assert "lemon" in refused.error.message
    await bus.publish(
        JobFinished(
            event_id="finished-j1", source="launcher", job_id="j1", tenant="t", outcome="succeeded"
        ),
        Subjects.JOB_FINISHED,
    )

    async def hot_gone() -> bool:
        page = await pool.rpc("list", {"cluster": "local"})
        return [s["slot_id"] for s in page["items"]] == ["local:lemon:0"]

    await until(hot_gone, "the finished job's hot spares to leave the pool")


async def left_for_silence(pool: Pool, slot_id: str) -> bool:
    """Whether the slot left the pool because its hot spare stopped heartbeating."""
    try:
        await pool.rpc("get", {"slot_id": slot_id})
    except RpcFailed as exc:
        return "stopped heartbeating" in exc.error.message
    return False


def fresh_job() -> str:
    """A job id of this test's alone (its generation must be the only one the pool reads)."""
    return f"ra{uuid.uuid4().hex[:10]}"


async def beat_as_spare(
    bus: Bus, stop: asyncio.Event, member_id: str, every_s: float = 0.1, job_id: str = "j1"
) -> None:
    """Send a hot spare's liveness beats (node n1, gpu 0, no rank) until ``stop``."""
    n = 0
    while not stop.is_set():
        n += 1
        await bus.publish_core(
            Subjects.heartbeat(job_id),
            Heartbeat(
                event_id=f"hb-{member_id}-{n}",
                source="agent",
                job_id=job_id,
                member_id=member_id,
                generation=0,
                step=-1,
                kind="liveness",
                node="n1",
                gpu=0,
                pid=1,
            ),
        )
        await asyncio.sleep(every_s)


async def test_a_hot_spare_that_stops_heartbeating_leaves_the_pool(
    start_pool: Callable[..., Awaitable[Pool]], bus: Bus
) -> None:
    pool = await start_pool(
        spare_sweep_interval_s=0.1, spare_heartbeat_grace_s=1.0, spare_heartbeat_timeout_s=1.0
    )
    for i in range(2):
        await pool.rpc(
            "register", slot_body("n1", i, state="hot", job_id="j1", member_id=f"j1-s{i}")
        )
    stop = asyncio.Event()
    beater = asyncio.create_task(beat_as_spare(bus, stop, "j1-s0", every_s=0.2))  # s1 is silent
    try:
        await until(
            functools.partial(left_for_silence, pool, "local:n1:1"),
            "the silent hot spare to leave the pool",
        )
        # Both were registered together, so the grace is over for both: beats keep j1-s0.
        alive = await pool.rpc("get", {"slot_id": "local:n1:0"})
        assert alive["state"] == "hot"
    finally:
        stop.set()
        await beater


async def test_a_hot_spare_whose_beats_resume_comes_back_until_its_job_ends(
    start_pool: Callable[..., Awaitable[Pool]], bus: Bus
) -> None:
    # A spare starved for longer than the pool waits (a loaded host importing torch) is
    # removed; it must not stay out for good while its process lives and its job runs.
    job = fresh_job()
    pool = await start_pool(
        spare_sweep_interval_s=0.1, spare_heartbeat_grace_s=0.5, spare_heartbeat_timeout_s=0.5
    )
    await pool.rpc("register", slot_body("n1", 0, state="hot", job_id=job, member_id=f"{job}-s0"))

    removed = functools.partial(left_for_silence, pool, "local:n1:0")
    await until(removed, "the silent hot spare to leave the pool")
    stop = asyncio.Event()
    beater = asyncio.create_task(beat_as_spare(bus, stop, f"{job}-s0", job_id=job))
    try:

        async def back() -> bool:
            try:
                got = await pool.rpc("get", {"slot_id": "local:n1:0"})
            except RpcFailed:
                return False
            return bool(got["state"] == "hot" and got["member_id"] == f"{job}-s0")

        await until(back, "the beating spare to be re-admitted")
        lease = await pool.rpc("reserve", {"job_id": job, "cluster": "local"})
        assert lease["slot"]["slot_id"] == "local:n1:0"
        await pool.rpc("release", {"lease_id": lease["lease_id"]})
    finally:
        stop.set()
        await beater

    # Silent again, then the job ends: its beats (a late one) no longer bring it back.
    await until(removed, "the spare, silent again, to leave the pool")
    await bus.publish(
        JobFinished(
            event_id=f"jf-{job}", source="launcher", job_id=job, tenant="t", outcome="succeeded"
        ),
        Subjects.JOB_FINISHED,
    )
    await asyncio.sleep(0.5)
    stop.clear()
    beater = asyncio.create_task(beat_as_spare(bus, stop, f"{job}-s0", job_id=job))
    await asyncio.sleep(1.0)
    stop.set()
    await beater
    assert await removed()


async def lapse(
    start_pool: Callable[..., Awaitable[Pool]], redis: aioredis.Redis, job: str, member: str
) -> tuple[Pool, Callable[[], Awaitable[bool]]]:
    """A pool whose hot spare ``member`` (of ``job``, on n1 gpu 0) was removed for silence.

    Returns the pool and a check: whether the pool still keeps the spare's registration.
    """
    pool = await start_pool(
        spare_sweep_interval_s=0.1, spare_heartbeat_grace_s=0.5, spare_heartbeat_timeout_s=0.5
    )
    await pool.rpc("register", slot_body("n1", 0, state="hot", job_id=job, member_id=member))

    async def kept() -> bool:
        return bool(await redis.hexists("tr:spare_pool:lapsed_reg", member))

    await until(kept, "the silent hot spare to be removed and its registration kept")
    return pool, kept


async def test_a_lapsed_spare_that_its_jobs_generation_names_does_not_come_back(
    start_pool: Callable[..., Awaitable[Pool]], bus: Bus, redis: aioredis.Redis
) -> None:
    # Named for a rank while it was starved: its first beats still say it holds none (it
    # has not seen the generation yet), but it is taking the rank, not waiting as a spare.
    job = fresh_job()
    pool, lapsed = await lapse(start_pool, redis, job, f"{job}-s0")
    await bus.put_generation(
        Generation(
            job_id=job,
            generation=2,
            world_size=2,
            ranks=[
                RankAssignment(rank=0, member_id=f"{job}-w0", node="n0", gpu=0),
                RankAssignment(rank=1, member_id=f"{job}-s0", node="n1", gpu=0),
            ],
            store_member=f"{job}-w0",
            store_addr="127.0.0.1:1",
        ),
        None,
    )
    stop = asyncio.Event()
    beater = asyncio.create_task(beat_as_spare(bus, stop, f"{job}-s0", job_id=job))
    try:

        async def taken() -> bool:
            return not await lapsed()

        await until(taken, "the pool to act on the lapsed spare's beat")
        await asyncio.sleep(0.5)  # the handler's last step would be the registration
    finally:
        stop.set()
        await beater
    gone = await pool.error("get", {"slot_id": "local:n1:0"})
    assert gone.error.code == "not_found"
    assert not await redis.zscore("tr:spare_pool:lapsed_at", f"{job}-s0")


async def test_a_lapsed_spare_whose_slot_was_registered_again_stays_out_for_good(
    start_pool: Callable[..., Awaitable[Pool]], bus: Bus, redis: aioredis.Redis
) -> None:
    job, other_job = fresh_job(), fresh_job()
    pool, lapsed = await lapse(start_pool, redis, job, f"{job}-s0")
    # Meanwhile the GPU became another job's hot spare (an idle one would simply be taken
    # back: the lapsed spare's process still runs on it).
    stop = asyncio.Event()
    other = asyncio.create_task(beat_as_spare(bus, stop, f"{other_job}-s0", job_id=other_job))
    await pool.rpc(
        "register", slot_body("n1", 0, state="hot", job_id=other_job, member_id=f"{other_job}-s0")
    )
    beater = asyncio.create_task(beat_as_spare(bus, stop, f"{job}-s0", job_id=job))
    try:

        async def dropped() -> bool:
            return not await lapsed()

        await until(dropped, "the pool to drop the registration it cannot restore")
        slot = await pool.rpc("get", {"slot_id": "local:n1:0"})
    finally:
        stop.set()
        await asyncio.gather(beater, other)
    assert (slot["state"], slot["job_id"], slot["member_id"]) == (
        "hot",
        other_job,
        f"{other_job}-s0",
    )


async def test_quarantine_revokes_leases_publishes_and_pool_low_fires_below_the_floor(
    start_pool: Callable[..., Awaitable[Pool]], bus: Bus
) -> None:
    pool = await start_pool(spare_floor="*=2")
    quarantined = await EventTap.start(bus, Subjects.SPARE_QUARANTINED)
    released = await EventTap.start(bus, Subjects.SPARE_RELEASED)
    low = await EventTap.start(bus, Subjects.SPARE_POOL_LOW)
    for node, gpu in (("a", 0), ("a", 1), ("b", 0)):
        await pool.rpc("register", slot_body(node, gpu, nvlink_domain="nvl-0"))
    assert await pool.rpc("depth", {"cluster": "local"}) == [
        {"cluster": "local", "nvlink_domain": "nvl-0", "available": 3, "floor": 2, "low": False}
    ]
    lease = await pool.rpc("reserve", {"job_id": "j1", "cluster": "local", "near_node": "a"})
    assert lease["slot"]["node"] == "b"  # same domain, but not the node that failed
    q = await pool.rpc("quarantine", {"node": "b", "reason": "xid 79", "cluster": "local"})
    assert q["revoked_leases"] == [lease["lease_id"]]
    await quarantined.wait("SpareQuarantined", lambda e: e["slot_id"] == "local:b:0")
    await released.wait("the revoked lease", lambda e: e["lease_id"] == lease["lease_id"])
    revoked = await pool.error("confirm", {"lease_id": lease["lease_id"]})
    assert revoked.error.code == "conflict"
    await pool.rpc("reserve", {"job_id": "j1", "cluster": "local"})
    events = await low.wait("SparePoolLow for nvl-0")
    assert SparePoolLow.model_validate(events[0]).available == 1
    assert events[0]["floor"] == 2
    # The gauge follows the lease in the background (the reply does not wait for it), and
    # the event above may be the one the first registration raised (1 spare < floor 2).
    gauge = 'spares_available{cluster="local",nvlink_domain="nvl-0"} 1.0'

    async def gauge_reads_one() -> bool:
        return gauge in await pool.metrics()

    await until(gauge_reads_one, "the spares_available gauge to read 1 after the second lease")
    # A slot registered on the quarantined node is quarantined too, until it is returned.
    registered = await pool.rpc("register", slot_body("b", 1, nvlink_domain="nvl-0"))
    assert registered["slot"]["state"] == "quarantined"
    returned = await pool.rpc("return", {"node": "b"})
    assert sorted(s["slot_id"] for s in returned["returned"]) == ["local:b:0", "local:b:1"]
    assert (await pool.rpc("depth", {}))[0]["available"] == 3
    assert SpareQuarantined.model_validate(quarantined.payloads[0]).state == "quarantined"
    assert SpareReleased.model_validate(released.payloads[0]).slot_id == "local:b:0"


async def test_a_malformed_floor_setting_stops_the_service_naming_the_variable(
    nats_url: str, redis_url: str
) -> None:
    env = {
        **os.environ,
        "NATS_URL": nats_url,
        "REDIS_URL": redis_url,
        "TORCHRELAY_SPARE_FLOOR": "nvl-0=lots",
        "TORCHRELAY_ENVIRONMENT": "test",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.spare_pool",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2, out.decode()[-2000:]
    assert "TORCHRELAY_SPARE_FLOOR" in out.decode()


async def test_a_launcher_takes_the_hot_spare_slot_a_job_that_just_finished_lets_go(
    start_pool: Callable[..., Awaitable[Pool]], bus: Bus
) -> None:
    # Back-to-back jobs on one host: job B's launcher registers its spare on the slot that is
    # still job A's hot spare, because the pool has not handled A's JobFinished yet.
    pool = await start_pool()
    await pool.rpc("register", slot_body("n1", 0, state="hot", job_id="ja", member_id="ja-s0"))
    slot = SpareSlot.model_validate(
        slot_body("n1", 0, state="hot", job_id="jb", member_id="jb-s0", slot_id="local:n1:0")
    )
    taking = asyncio.create_task(register_hot_spare(bus, slot, retry_s=15.0))
    await asyncio.sleep(0.6)
    assert not taking.done()  # refused so far, and asking again
    await bus.publish(
        JobFinished(
            event_id="finished-ja", source="launcher", job_id="ja", tenant="t", outcome="succeeded"
        ),
        Subjects.JOB_FINISHED,
    )
    assert await asyncio.wait_for(taking, DEADLINE_S) is None
    assert (await pool.rpc("get", {"slot_id": "local:n1:0"}))["job_id"] == "jb"
    # A slot that stays another live job's is refused, naming the job, once the retry ends.
    other = slot.model_copy(update={"job_id": "jc", "member_id": "jc-s0"})
    problem = await register_hot_spare(bus, other, retry_s=1.0)
    assert problem is not None
    assert "slot local:n1:0 is a hot spare of job jb" in problem
