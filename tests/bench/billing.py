"""Billing ledger benchmark: appends per second and guarantee-query latency at 1M entries.

Runs against a redis-server of its own, started with the production durability
(AOF ``appendfsync always``), in a temporary directory:

1. the ledger is filled to ``TORCHRELAY_BENCH_BILLING_ENTRIES`` entries (default 1,000,000)
   spread over ``TORCHRELAY_BENCH_BILLING_CONTRACTS`` contracts (default 1,000: 250 tenants
   with a contract for each quarter of 2025). Every entry is a real incident entry in the
   real layout, written by the ledger's own append script (``APPEND_LUA``, by its SHA) with
   the arguments ``Ledger.record`` passes, so the script checks the head, writes the entry,
   the index and the aggregates. What the fill does differently from ``Ledger.record`` is
   only the client side: the incident JSON and the sealed entry are built without a
   pydantic round trip per entry (checked equal to the pydantic form and to ``chain.seal``
   on samples), and the EVALSHA commands go over ``TORCHRELAY_BENCH_BILLING_CONNECTIONS``
   plain RESP connections (default 8), ``TORCHRELAY_BENCH_BILLING_BATCH`` (default 250) per
   round trip, one chain per connection at a time. The fill stops at
   ``TORCHRELAY_BENCH_BILLING_FILL_S`` seconds (default 420) if it has not reached the
   target; the result says how many entries there were when measured
   (``entries_measured_at``), and the hash chains and aggregates of sampled contracts are
   verified afterwards;
2. on the filled ledger, appends/s through ``Ledger.record`` (the real path: contract
   lookup, entry hash, the Lua append script, one fsync'd round trip each), one writer, then
   32 concurrent writers on 32 contracts, and duplicate answers/s;
3. guarantee-query latency (``Ledger.guarantee``: the contract and its aggregate) with those
   entries in the store, p50/p99 over 2,000 queries spread over the filled contracts;
4. ``ledger verify`` speed over one filled chain.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import random
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
# The fill's tenants have quarterly terms: contract k is quarter k % 4 of tenant k // 4.
QUARTERS = (*(datetime(2025, m, 1, tzinfo=UTC) for m in (1, 4, 7, 10)), TERM_END)
RESOLUTIONS = (
    Resolution.MIGRATED_LIVE,
    Resolution.MIGRATED_LIVE,
    Resolution.LOST,
    Resolution.MIGRATED_PROACTIVE,
)


def _offset_s(quarter: int | None) -> int:
    return 0 if quarter is None else int((QUARTERS[quarter] - TERM_START).total_seconds())


def _incident_id(n: int, tenant: str, quarter: int | None) -> str:
    return f"{tenant}-{n}" if quarter is None else f"{tenant}-q{quarter + 1}-{n}"


def incident(n: int, tenant: str, quarter: int | None = None) -> Incident:
    """The ``n``-th incident of ``tenant`` in 2025 or in ``quarter`` (0-3) of 2025, one
    second apart from the term's start."""
    start = TERM_START + timedelta(seconds=_offset_s(quarter))
    return Incident(
        incident_id=_incident_id(n, tenant, quarter),
        tenant=tenant,
        job_id=f"job-{n % 97}",
        rank=n % 8,
        node=f"node-{n % 512}",
        gpu=n % 8,
        fault_kind=FaultKind.GPU_LOST,
        severity=Severity.FATAL,
        detected_at=start + timedelta(seconds=n),
        resolved_at=start + timedelta(seconds=n + 1),
        resolution=RESOLUTIONS[n % 4],
        stall_ms=57.0,
        lost_steps=0,
        bytes_moved=1 << 20,
        generation_before=1,
        generation_after=2,
    )


@functools.lru_cache(maxsize=1 << 16)
def _instant(seconds: int) -> str:
    return (TERM_START + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def incident_json(n: int, tenant: str, quarter: int | None = None) -> dict[str, Any]:
    """``incident(n, tenant, quarter).model_dump(mode="json")`` without pydantic."""
    offset = _offset_s(quarter)
    return {
        "incident_id": _incident_id(n, tenant, quarter),
        "tenant": tenant,
        "job_id": f"job-{n % 97}",
        "rank": n % 8,
        "node": f"node-{n % 512}",
        "gpu": n % 8,
        "fault_kind": "gpu_lost",
        "severity": "fatal",
        "detected_at": _instant(offset + n),
        "resolved_at": _instant(offset + n + 1),
        "resolution": RESOLUTIONS[n % 4].value,
        "stall_ms": 57.0,
        "lost_steps": 0,
        "bytes_moved": 1 << 20,
        "generation_before": 1,
        "generation_after": 2,
        "cluster": "local",
        "fault_id": None,
    }


CLASS_OF = {r.value: classify(incident(i, "t")).value for i, r in enumerate(RESOLUTIONS)}


async def contract(ledger: Ledger, tenant: str, quarter: int | None = None) -> str:
    """A contract of ``tenant`` for 2025, or for ``quarter`` (0-3) of 2025."""
    c, _ = await ledger.create_contract(
        ContractRequest.model_validate(
            {
                "tenant": tenant,
                "term_start": TERM_START if quarter is None else QUARTERS[quarter],
                "term_end": TERM_END if quarter is None else QUARTERS[quarter + 1],
                "renewal_fee_minor": 1_000_000,
                "currency": "USD",
            }
        )
    )
    return c.contract_id


def _bulk(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return b"$%d\r\n%s\r\n" % (len(data), data)


class ChainFiller:
    """Builds the append commands of one chain exactly as ``Ledger.record`` would.

    ``Ledger.record`` seals ``{seq, chain, kind, incident_id, class, incident, digest,
    recorded_at, prev_hash}`` (``chain.seal``: sha256 of the canonical JSON without ``hash``)
    and passes the script the entry, its hash, the content digest and the content. Here the
    canonical texts are assembled from the incident's canonical JSON, once per entry instead
    of four times; :meth:`check` compares the result with ``seal``/``canonical_json`` of the
    pydantic incident.
    """

    def __init__(
        self, ledger: Ledger, chain: str, tenant: str, quarter: int, recorded_at: datetime
    ) -> None:
        self.ledger = ledger
        self.chain = chain
        self.tenant = tenant
        self.quarter = quarter
        self.recorded_at = recorded_at.isoformat()
        self.now_us = str(epoch_us(recorded_at))
        self.seq = 0
        self.prev = "0" * 64
        self.sha = ledger._append.sha

    def entry(self, n: int) -> tuple[list[str], str, str]:
        """The script's keys and args for incident ``n``, the entry text and its hash."""
        content = incident_json(n, self.tenant, self.quarter)
        content_text = canonical_json(content)
        content_digest = hashlib.sha256(content_text.encode()).hexdigest()
        cls = CLASS_OF[content["resolution"]]
        incident_id = content["incident_id"]
        # The body with a placeholder for the incident, then the incident's canonical text
        # spliced in: the keys before "incident" (chain, class, digest) hold no such text.
        body = canonical_json(
            {
                "seq": self.seq + 1,
                "chain": self.chain,
                "kind": "incident",
                "incident_id": incident_id,
                "class": cls,
                "incident": 0,
                "digest": content_digest,
                "recorded_at": self.recorded_at,
                "prev_hash": self.prev,
            }
        ).replace(',"incident":0,', ',"incident":' + content_text + ",", 1)
        entry_hash = hashlib.sha256(body.encode()).hexdigest()
        entry_text = body.replace(',"incident":{', ',"hash":"' + entry_hash + '","incident":{', 1)
        args = [
            "incident",
            self.chain,
            str(self.seq),
            self.prev,
            entry_text,
            entry_hash,
            content_digest,
            cls,
            "",
            content_text,
            "",
            "",
            "",
            "0",
            self.now_us,
            incident_id,
        ]
        return self.ledger._keys(self.chain, incident_id), args, entry_hash

    def command(self, n: int) -> bytes:
        """The EVALSHA of incident ``n`` in RESP; advances the local head."""
        keys, args, entry_hash = self.entry(n)
        parts = [b"*%d\r\n$7\r\nEVALSHA\r\n" % (3 + len(keys) + len(args)), _bulk(self.sha)]
        parts.append(_bulk(str(len(keys))))
        parts.extend(_bulk(k) for k in keys)
        parts.extend(_bulk(a) for a in args)
        self.seq += 1
        self.prev = entry_hash
        return b"".join(parts)

    def check(self, n: int) -> None:
        """Raise unless incident ``n`` built here equals ``Ledger.record``'s form of it."""
        real = incident(n, self.tenant, self.quarter)
        content = real.model_dump(mode="json")
        if incident_json(n, self.tenant, self.quarter) != content:
            raise AssertionError(f"incident_json({n}) differs from the pydantic incident")
        _, args, _ = self.entry(n)
        expected = seal(
            {
                "seq": self.seq + 1,
                "chain": self.chain,
                "kind": "incident",
                "incident_id": real.incident_id,
                "class": classify(real).value,
                "incident": content,
                "digest": digest(content),
                "recorded_at": self.recorded_at,
                "prev_hash": self.prev,
            }
        )
        if (args[4], args[5], args[6], args[7], args[9]) != (
            canonical_json(expected),
            expected["hash"],
            digest(content),
            classify(real).value,
            canonical_json(content),
        ):
            raise AssertionError(f"entry {n} of {self.chain} differs from chain.seal's")


class Resp:
    """One plain RESP2 connection: send pipelined commands, read their replies."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> Resp:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
        return cls(reader, writer)

    async def _reply(self) -> Any:
        line = await self.reader.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b"*":
            return [await self._reply() for _ in range(int(rest))]
        if kind == b"$":
            size = int(rest)
            return None if size < 0 else (await self.reader.readexactly(size + 2))[:-2]
        if kind == b"-":
            raise RuntimeError(f"redis refused an append: {rest.decode()}")
        return rest

    async def pipeline(self, commands: list[bytes]) -> list[Any]:
        self.writer.write(b"".join(commands))
        await self.writer.drain()
        return [await self._reply() for _ in commands]

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def fill(
    ledger: Ledger,
    host: str,
    port: int,
    fillers: list[ChainFiller],
    per_chain: int,
    connections: int,
    batch: int,
    deadline: float,
) -> int:
    """Append ``per_chain`` incidents to each chain; the number appended before ``deadline``."""
    queue: asyncio.Queue[ChainFiller] = asyncio.Queue()
    for filler in fillers:
        queue.put_nowait(filler)
    await ledger.redis.script_load(ledger._append.script)
    appended = 0

    async def worker() -> None:
        nonlocal appended
        conn = await Resp.open(host, port)
        try:
            while not queue.empty() and time.perf_counter() < deadline:
                filler = queue.get_nowait()
                for lo in range(0, per_chain, batch):
                    if time.perf_counter() >= deadline:
                        return
                    filler.check(lo)
                    replies = await conn.pipeline(
                        [filler.command(n) for n in range(lo, min(lo + batch, per_chain))]
                    )
                    bad = [r for r in replies if r[0] != b"ok"]
                    if bad:
                        raise RuntimeError(f"fill of {filler.chain} got {bad[0]!r}")
                    appended += len(replies)
        finally:
            await conn.close()

    await asyncio.gather(*(worker() for _ in range(connections)))
    return appended


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, str(default)))


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1000, ordered[int(len(ordered) * 0.99)] * 1000


async def measure(url: str, host: str, port: int) -> dict[str, Any]:
    target = _env_int("TORCHRELAY_BENCH_BILLING_ENTRIES", 1_000_000)
    n_contracts = _env_int("TORCHRELAY_BENCH_BILLING_CONTRACTS", 1000)
    connections = _env_int("TORCHRELAY_BENCH_BILLING_CONNECTIONS", 8)
    batch = _env_int("TORCHRELAY_BENCH_BILLING_BATCH", 250)
    fill_budget = float(os.environ.get("TORCHRELAY_BENCH_BILLING_FILL_S", "420"))
    client = aioredis.from_url(url)
    ledger = Ledger(client)
    out: dict[str, Any] = {"durability": "AOF appendfsync always"}
    try:
        # 1. fill: n_contracts chains of per_chain real entries each
        per_chain = max(1, target // n_contracts)
        t0 = time.perf_counter()
        fillers = [
            ChainFiller(
                ledger,
                await contract(ledger, f"fill{k // 4}", k % 4),
                f"fill{k // 4}",
                k % 4,
                datetime.now(UTC),
            )
            for k in range(n_contracts)
        ]
        appended = await fill(
            ledger, host, port, fillers, per_chain, connections, batch, t0 + fill_budget
        )
        fill_s = time.perf_counter() - t0
        entries = appended
        out["fill_entries_per_s_pipelined"] = appended / fill_s
        out["fill_s"] = fill_s
        out["fill_method"] = (
            f"the ledger's append script by EVALSHA, {connections} connections, {batch} "
            f"per round trip, {n_contracts} contracts (quarterly terms of {n_contracts // 4} "
            "tenants)"
        )
        # Spot-check the filled ledger as `ledger verify` would: hash chain, head, aggregates.
        rng = random.Random(7)
        filled = [f.chain for f in fillers if f.seq > 0]
        for chain in rng.sample(filled, min(5, len(filled))):
            report = await ledger.verify(chain)
            if not report["ok"]:
                raise AssertionError(f"filled chain {chain} does not verify: {report}")
        async with client.pipeline(transaction=False) as pipe:
            for chain in filled:
                pipe.llen(ledger.key("chain", chain))
            stored = sum(await pipe.execute())
        if stored != appended:
            raise AssertionError(f"{appended} appends answered ok but {stored} entries stored")

        # 2. appends/s on the filled ledger through Ledger.record
        cid = await contract(ledger, "seq")
        n_seq = 2000
        t0 = time.perf_counter()
        for n in range(n_seq):
            assert (await ledger.record(incident(n, "seq"))).outcome == "ok"
        out["appends_per_s_1_writer"] = n_seq / (time.perf_counter() - t0)
        writers, per_writer = 32, 300
        for w in range(writers):
            await contract(ledger, f"w{w}")

        async def write(w: int) -> None:
            for n in range(per_writer):
                assert (await ledger.record(incident(n, f"w{w}"))).outcome == "ok"

        t0 = time.perf_counter()
        await asyncio.gather(*(write(w) for w in range(writers)))
        out["appends_per_s_32_writers"] = writers * per_writer / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for n in range(1000):
            assert (await ledger.record(incident(n, "seq"))).outcome == "exists"
        out["duplicate_answers_per_s"] = 1000 / (time.perf_counter() - t0)
        entries += n_seq + writers * per_writer
        out["entries_target"] = target
        out["entries_measured_at"] = entries
        info = await client.info("memory")
        out["redis_used_memory_mb"] = int(info["used_memory"]) / 2**20

        # 3. guarantee latency with that many entries (a fresh Ledger: no contract cached)
        reader = Ledger(client)
        queried = [cid, *filled]
        samples = []
        for i in range(2000):
            t1 = time.perf_counter()
            g = await reader.guarantee(queried[(i * 7919) % len(queried)])
            samples.append(time.perf_counter() - t1)
        assert g.eligible_failures > 0
        out["guarantee_p50_ms"], out["guarantee_p99_ms"] = _percentiles(samples)
        out["guarantee_queries"] = len(samples)

        # 4. verify one filled chain
        t0 = time.perf_counter()
        report = await ledger.verify(filled[0])
        assert report["ok"], report
        out["verify_entries_per_s"] = report["checked"] / (time.perf_counter() - t0)
    finally:
        await client.aclose()
    out["summary"] = (
        f"at {out['entries_measured_at']:,} entries: {out['appends_per_s_1_writer']:.0f} "
        f"appends/s (1 writer), {out['appends_per_s_32_writers']:.0f}/s (32 writers); "
        f"guarantee p50 {out['guarantee_p50_ms']:.2f} ms p99 {out['guarantee_p99_ms']:.2f} ms"
    )
    return out


def run() -> dict[str, Any]:
    """Measure, print a small table, return the figures."""
    with tempfile.TemporaryDirectory(prefix="bench-billing-") as tmp:
        server = redis_server(Path(tmp))
        server.start()
        try:
            result = asyncio.run(measure(server.url, server.host, server.port))
        finally:
            server.stop(timeout=60)
    width = max(len(k) for k in result)
    for key, value in result.items():
        shown = f"{value:,.3f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    return result


if __name__ == "__main__":
    run()
