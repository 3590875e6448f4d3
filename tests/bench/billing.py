"""Billing ledger benchmark: appends per second and guarantee-query latency at scale.

Runs against a redis-server of its own, started with the production durability
(AOF ``appendfsync always``), in a temporary directory:

1. appends/s through ``Ledger.record`` (the real path: contract lookup, entry hash, the Lua
   append script), one writer, then 32 concurrent writers on 32 contracts;
2. the ledger is filled to ``TORCHRELAY_BENCH_BILLING_ENTRIES`` entries (default 1,000,000,
   across 1,000 contracts) with the same Lua script and entry format, pipelined 500 at a
   time (one round trip and one fsync per batch);
3. guarantee-query latency (``Ledger.guarantee``: the contract and its aggregate) with that
   many entries in the store, p50/p99 over 2,000 queries;
4. ``ledger verify`` speed over one 20,000-entry chain.

If the fill would take too long it stops at ``TORCHRELAY_BENCH_BILLING_FILL_S`` seconds
(default 180) and the result says how many entries were actually there when measured.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from services.billing.chain import canonical_json, digest, seal
from services.billing.ledger import Ledger
from services.billing.rules import ContractRequest, classify, epoch_us
from torchrelay.contract import FaultKind, Incident, Resolution, Severity
from torchrelay.runtime import redis_server

TERM_START = datetime(2025, 1, 1, tzinfo=UTC)
TERM_END = datetime(2026, 1, 1, tzinfo=UTC)


def incident(n: int, tenant: str) -> Incident:
    res = (
        Resolution.MIGRATED_LIVE,
        Resolution.MIGRATED_LIVE,
        Resolution.LOST,
        Resolution.MIGRATED_PROACTIVE,
    )[n % 4]
    return Incident(
        incident_id=f"{tenant}-{n}",
        tenant=tenant,
        job_id=f"job-{n % 97}",
        rank=n % 8,
        node=f"node-{n % 512}",
        gpu=n % 8,
        fault_kind=FaultKind.GPU_LOST,
        severity=Severity.FATAL,
        detected_at=TERM_START + timedelta(seconds=n),
        resolved_at=TERM_START + timedelta(seconds=n + 1),
        resolution=res,
        stall_ms=57.0,
        lost_steps=0,
        bytes_moved=1 << 20,
        generation_before=1,
        generation_after=2,
    )


async def contract(ledger: Ledger, tenant: str) -> str:
    c, _ = await ledger.create_contract(
        ContractRequest.model_validate(
            {
                "tenant": tenant,
                "term_start": TERM_START,
                "term_end": TERM_END,
                "renewal_fee_minor": 1_000_000,
                "currency": "USD",
            }
        )
    )
    return c.contract_id


async def fill_chain(
    ledger: Ledger, tenant: str, chain: str, first: int, count: int, batch: int = 500
) -> None:
    """Append ``count`` incidents to one chain with the real script, pipelined."""
    seq, prev = await ledger.head(chain)
    now = datetime.now(UTC)
    for lo in range(first, first + count, batch):
        async with ledger.redis.pipeline(transaction=False) as pipe:
            for n in range(lo, min(lo + batch, first + count)):
                inc = incident(n, tenant)
                content = inc.model_dump(mode="json")
                content_digest = digest(content)
                cls = classify(inc).value
                entry = seal(
                    {
                        "seq": seq + 1,
                        "chain": chain,
                        "kind": "incident",
                        "incident_id": inc.incident_id,
                        "class": cls,
                        "incident": content,
                        "digest": content_digest,
                        "recorded_at": now.isoformat(),
                        "prev_hash": prev,
                    }
                )
                await ledger._append(
                    keys=ledger._keys(chain, inc.incident_id),
                    args=[
                        "incident",
                        chain,
                        seq,
                        prev,
                        canonical_json(entry),
                        entry["hash"],
                        content_digest,
                        cls,
                        "",
                        canonical_json(content),
                        "",
                        "",
                        "",
                        0,
                        epoch_us(now),
                        inc.incident_id,
                    ],
                    client=pipe,
                )
                seq, prev = seq + 1, str(entry["hash"])
            results = await pipe.execute()
        bad = [r for r in results if r[0] != b"ok"]
        if bad:
            raise RuntimeError(f"fill of {chain} got {bad[0]!r}")


async def measure(url: str) -> dict[str, Any]:
    target = int(os.environ.get("TORCHRELAY_BENCH_BILLING_ENTRIES", "1000000"))
    fill_budget = float(os.environ.get("TORCHRELAY_BENCH_BILLING_FILL_S", "180"))
    client = aioredis.from_url(url)
    ledger = Ledger(client)
    out: dict[str, Any] = {"durability": "AOF appendfsync always"}
    try:
        # 1a. one writer
        cid = await contract(ledger, "seq")
        n_seq = 2000
        t0 = time.perf_counter()
        for n in range(n_seq):
            assert (await ledger.record(incident(n, "seq"))).outcome == "ok"
        out["appends_per_s_1_writer"] = n_seq / (time.perf_counter() - t0)
        # 1b. 32 concurrent writers, one contract each
        writers, per_writer = 32, 300
        for w in range(writers):
            await contract(ledger, f"w{w}")

        async def write(w: int) -> None:
            for n in range(per_writer):
                assert (await ledger.record(incident(n, f"w{w}"))).outcome == "ok"

        t0 = time.perf_counter()
        await asyncio.gather(*(write(w) for w in range(writers)))
        out["appends_per_s_32_writers"] = writers * per_writer / (time.perf_counter() - t0)
        # duplicates are answered without writing
        t0 = time.perf_counter()
        for n in range(1000):
            assert (await ledger.record(incident(n, "seq"))).outcome == "exists"
        out["duplicate_answers_per_s"] = 1000 / (time.perf_counter() - t0)

        # 2. fill to the target
        entries = n_seq + writers * per_writer
        contracts, per_contract = 1000, max(1, (target - entries) // 1000)
        t0 = time.perf_counter()
        filled: list[str] = []
        for k in range(contracts):
            if entries >= target or time.perf_counter() - t0 > fill_budget:
                break
            tenant = f"fill{k}"
            chain = await contract(ledger, tenant)
            await fill_chain(ledger, tenant, chain, 0, min(per_contract, target - entries))
            entries += min(per_contract, target - entries)
            filled.append(chain)
        fill_s = time.perf_counter() - t0
        out["fill_entries_per_s_pipelined"] = (entries - n_seq - writers * per_writer) / fill_s
        out["entries_target"] = target
        out["entries_measured_at"] = entries
        out["fill_s"] = fill_s
        info = await client.info("memory")
        out["redis_used_memory_mb"] = int(info["used_memory"]) / 2**20

        # 3. guarantee latency with that many entries
        samples = []
        queried = [cid, *filled]
        for i in range(2000):
            t1 = time.perf_counter()
            g = await ledger.guarantee(queried[i % len(queried)])
            samples.append(time.perf_counter() - t1)
        assert g.eligible_failures > 0
        samples.sort()
        out["guarantee_p50_ms"] = statistics.median(samples) * 1000
        out["guarantee_p99_ms"] = samples[int(len(samples) * 0.99)] * 1000

        # 4. verify one long chain
        vchain = await contract(ledger, "verify")
        await fill_chain(ledger, "verify", vchain, 0, 20_000)
        t0 = time.perf_counter()
        report = await ledger.verify(vchain)
        assert report["ok"], report
        out["verify_entries_per_s"] = report["checked"] / (time.perf_counter() - t0)
    finally:
        await client.aclose()
    out["summary"] = (
        f"{out['appends_per_s_1_writer']:.0f} appends/s (1 writer), "
        f"{out['appends_per_s_32_writers']:.0f}/s (32 writers); guarantee p50 "
        f"{out['guarantee_p50_ms']:.2f} ms p99 {out['guarantee_p99_ms']:.2f} ms "
        f"at {out['entries_measured_at']:,} entries"
    )
    return out


def run() -> dict[str, Any]:
    """Measure, print a small table, return the figures."""
    with tempfile.TemporaryDirectory(prefix="bench-billing-") as tmp:
        server = redis_server(Path(tmp))
        server.start()
        try:
            result = asyncio.run(measure(server.url))
        finally:
            server.stop(timeout=60)
    width = max(len(k) for k in result)
    for key, value in result.items():
        shown = f"{value:,.3f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    return result


if __name__ == "__main__":
    run()
