"""Spare-pool benchmark: reservations per second and latency percentiles.

Two paths, each against a real ``redis-server`` (AOF ``appendfsync always``, as deployed):

- ``inventory``: the Lua reservation called directly (what one Redis round trip costs);
  sequential reserve+release pairs for latency, then 8 clients at once for throughput.
- ``rpc``: the whole service in-process on a real ``nats-server`` — request/reply, the Lua
  script, the ``SpareReserved`` publish to JetStream (fsync always) and the depth check —
  i.e. what the migration executor waits for.

The inventory holds 1,000 idle spares over 16 NVLink domains / 4 racks / 2 zones; every
reservation names a random ``near_node`` so the locality tiers are exercised.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from services.spare_pool.inventory import SpareInventory
from services.spare_pool.rules import ReserveRequest
from services.spare_pool.service import SparePoolSettings, setup
from torchrelay.bus import Bus
from torchrelay.contract import SpareSlot, Subjects
from torchrelay.runtime import nats_server, redis_server
from torchrelay.service import serve_service

SPARES = 1000
NODES = SPARES // 8
SEQUENTIAL = 1500
CONCURRENT_CLIENTS = 8
CONCURRENT_PER_CLIENT = 200
RPC_SEQUENTIAL = 400
RPC_CONCURRENT = 400


def _slot(i: int) -> SpareSlot:
    node = i // 8
    return SpareSlot(
        slot_id=f"bench:n{node}:{i % 8}",
        cluster="bench",
        node=f"n{node}",
        gpu=i % 8,
        gpu_model="H100",
        memory_mb=80_000,
        nvlink_domain=f"nvl-{node % 16}",
        rack=f"rack-{node % 4}",
        zone=f"zone-{node % 2}",
    )


def _percentiles(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000.0

    return {"p50_ms": pct(0.50), "p99_ms": pct(0.99), "mean_ms": statistics.fmean(ordered) * 1000.0}


def _request(rng: random.Random, job: str) -> ReserveRequest:
    return ReserveRequest(job_id=job, cluster="bench", near_node=f"n{rng.randrange(NODES)}")


async def _inventory_bench(redis_url: str) -> dict[str, Any]:
    client = aioredis.from_url(redis_url)
    await client.flushdb()
    inv = SpareInventory(client, "tr:spare_pool")
    for i in range(SPARES):
        await inv.register(_slot(i))
    rng = random.Random(7)
    latencies: list[float] = []
    started = time.perf_counter()
    for k in range(SEQUENTIAL):
        t0 = time.perf_counter()
        outcome = await inv.reserve(_request(rng, f"job{k % 50}"))
        latencies.append(time.perf_counter() - t0)
        assert outcome.lease is not None
        await inv.release(outcome.lease.lease_id, "bench")
    pair_rate = SEQUENTIAL / (time.perf_counter() - started)

    # Throughput: several clients racing, each reserve followed by its release.
    clients = [aioredis.from_url(redis_url) for _ in range(CONCURRENT_CLIENTS)]
    granted = 0

    async def worker(idx: int) -> None:
        nonlocal granted
        mine = SpareInventory(clients[idx], "tr:spare_pool")
        wrng = random.Random(idx)
        for k in range(CONCURRENT_PER_CLIENT):
            outcome = await mine.reserve(_request(wrng, f"job{idx}-{k}"))
            if outcome.lease is not None:
                granted += 1
                await mine.release(outcome.lease.lease_id, "bench")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(CONCURRENT_CLIENTS)))
    elapsed = time.perf_counter() - t0
    problems = await inv.audit()
    for c in clients:
        await c.aclose()
    await client.aclose()
    return {
        "sequential_reservations": SEQUENTIAL,
        "sequential_reserve_release_pairs_per_s": pair_rate,
        **_percentiles(latencies),
        "concurrent_clients": CONCURRENT_CLIENTS,
        "concurrent_reservations_per_s": granted / elapsed,
        "audit_problems": len(problems),
    }


async def _rpc_bench(nats_url: str, redis_url: str) -> dict[str, Any]:
    client = aioredis.from_url(redis_url)
    await client.flushdb()
    settings = SparePoolSettings(
        nats_url=nats_url, redis_url=redis_url, environment="test", log_level="ERROR"
    )
    stop = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.create_task(
        serve_service("spare_pool", setup, settings, stop=stop, on_ready=lambda _p: ready.set())
    )
    await asyncio.wait_for(ready.wait(), 60)
    bus = await Bus.connect(nats_url, "bench")
    try:
        for i in range(SPARES):
            s = _slot(i)
            await bus.request(Subjects.rpc("spare_pool", "register"), s, timeout=10)
        rng = random.Random(11)
        latencies: list[float] = []
        started = time.perf_counter()
        for k in range(RPC_SEQUENTIAL):
            req = _request(rng, f"job{k % 50}").model_dump(exclude_none=True)
            t0 = time.perf_counter()
            lease = await bus.request(Subjects.rpc("spare_pool", "reserve"), req, timeout=10)
            latencies.append(time.perf_counter() - t0)
            await bus.request(
                Subjects.rpc("spare_pool", "release"),
                {"lease_id": lease["lease_id"], "reason": "bench"},
                timeout=10,
            )
        pair_rate = RPC_SEQUENTIAL / (time.perf_counter() - started)

        async def reserve(k: int) -> None:
            req = _request(random.Random(k), f"burst{k}").model_dump(exclude_none=True)
            await bus.request(Subjects.rpc("spare_pool", "reserve"), req, timeout=60)

        t0 = time.perf_counter()
        await asyncio.gather(*(reserve(k) for k in range(RPC_CONCURRENT)))
        burst_rate = RPC_CONCURRENT / (time.perf_counter() - t0)
    finally:
        await bus.close()
        stop.set()
        await asyncio.wait_for(task, 30)
        await client.aclose()
    return {
        "sequential_reservations": RPC_SEQUENTIAL,
        "sequential_reserve_release_pairs_per_s": pair_rate,
        **_percentiles(latencies),
        "burst_reservations": RPC_CONCURRENT,
        "burst_reservations_per_s": burst_rate,
    }


def run() -> dict[str, Any]:
    """Measure, print a small table, and return the figures."""
    with tempfile.TemporaryDirectory(prefix="bench-spare-pool-") as tmp:
        redis_proc = redis_server(Path(tmp) / "r")
        nats_proc = nats_server(Path(tmp) / "n")
        redis_proc.start()
        nats_proc.start()
        try:
            inventory = asyncio.run(_inventory_bench(redis_proc.url))
            rpc = asyncio.run(_rpc_bench(nats_proc.url, redis_proc.url))
        finally:
            nats_proc.stop()
            redis_proc.stop()
    print(
        f"spare pool: {SPARES} idle spares, 16 NVLink domains, random near_node; "
        "Redis AOF fsync always, JetStream sync always"
    )
    print(f"{'path':<34} {'reserv./s':>10} {'p50 ms':>8} {'p99 ms':>8}")
    print(
        f"{'Lua script, sequential (pairs)':<34} "
        f"{inventory['sequential_reserve_release_pairs_per_s']:>10.0f} "
        f"{inventory['p50_ms']:>8.2f} {inventory['p99_ms']:>8.2f}"
    )
    print(
        f"{f'Lua script, {CONCURRENT_CLIENTS} clients at once':<34} "
        f"{inventory['concurrent_reservations_per_s']:>10.0f} {'':>8} {'':>8}"
    )
    print(
        f"{'RPC service, sequential (pairs)':<34} "
        f"{rpc['sequential_reserve_release_pairs_per_s']:>10.0f} "
        f"{rpc['p50_ms']:>8.2f} {rpc['p99_ms']:>8.2f}"
    )
    print(
        f"{f'RPC service, burst of {RPC_CONCURRENT}':<34} "
        f"{rpc['burst_reservations_per_s']:>10.0f} {'':>8} {'':>8}"
    )
    print("(p50/p99: latency of one reservation; pairs/s counts a reserve and its release)")
    return {
        "summary": (
            f"rpc {rpc['burst_reservations_per_s']:.0f} reservations/s, "
            f"p99 {rpc['p99_ms']:.2f} ms; lua p99 {inventory['p99_ms']:.2f} ms"
        ),
        "reservations_per_s": rpc["burst_reservations_per_s"],
        "p99_ms": rpc["p99_ms"],
        "spares": SPARES,
        "inventory": inventory,
        "rpc": rpc,
    }


if __name__ == "__main__":
    run()
