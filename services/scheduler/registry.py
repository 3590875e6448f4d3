"""The scheduler's job registry in Redis: jobs, the placement of every rank per generation,
committed steps and each job's timeline. Only the scheduler writes under ``tr:scheduler``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from torchrelay.contract import GenerationChanged, JobFinished, JobRegistered, Role
from torchrelay.generations import member_order

from .rules import RankPlacement

# Keeps the highest committed step: heartbeats arrive out of order across agents.
_MAX_SCRIPT = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or tonumber(cur) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
  return 1
end
return 0
"""

FINISHED_STATES = ("succeeded", "failed", "cancelled")


def _ms(at: datetime) -> float:
    return at.timestamp() * 1000.0


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class JobRegistry:
    """Jobs and placements under ``<prefix>:job:*``."""

    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self._r = redis
        self._p = prefix

    # ------------------------------------------------------------------ writes

    async def register(self, event: JobRegistered) -> dict[str, Any]:
        """Record a job; a redelivered registration keeps what later events added."""
        existing = await self.get(event.job_id)
        if existing is not None:
            if event.nnodes > 1:
                return await self._add_host(event)
            return existing
        workers = [m for m in event.members if m.role == Role.WORKER]
        job: dict[str, Any] = {
            "job_id": event.job_id,
            "tenant": event.tenant,
            "cluster": event.cluster,
            "world_size": event.world_size,
            "spares": event.spares,
            "policy": event.policy.value,
            "wait_timeout_s": event.wait_timeout_s,
            "allow_shrink": event.allow_shrink,
            "launcher_id": event.launcher_id,
            "checkpoint_every": event.checkpoint_every,
            "members": [m.model_dump(mode="json") for m in event.members],
            "state": "starting",
            "generation": 0,
            # Until generation 1 is formed, ranks follow the protocol's planned order.
            "ranks": [
                {"rank": i, "member_id": m.member_id, "node": m.node, "gpu": m.gpu, "pid": m.pid}
                for i, m in enumerate(workers[: event.world_size])
            ],
            "registered_at": event.occurred_at.isoformat(),
            "finished_at": None,
            "outcome": None,
        }
        pipe = self._r.pipeline(transaction=True)
        pipe.set(self._key(event.job_id), json.dumps(job))
        pipe.zadd(f"{self._p}:jobs", {event.job_id: _ms(event.occurred_at)})
        pipe.sadd(f"{self._p}:jobs:active", event.job_id)
        await pipe.execute()
        await self._index_nodes(event.job_id, event.cluster, job["ranks"])
        await self.add_timeline(
            event.job_id,
            event.occurred_at,
            {
                "type": "job_registered",
                "world_size": event.world_size,
                "spares": event.spares,
                "policy": event.policy.value,
            },
        )
        return job

    async def _add_host(self, event: JobRegistered) -> dict[str, Any]:
        """Another host of a job across hosts registered: its members join the job's, and
        until generation 1 the planned ranks follow the members' order (``-w<rank>``)."""

        def merge(job: dict[str, Any]) -> bool:
            known = {m["member_id"] for m in job["members"]}
            new = [m.model_dump(mode="json") for m in event.members if m.member_id not in known]
            if not new:
                return False
            job["members"] += new
            if int(job.get("generation", 0)) == 0:
                workers = sorted(
                    (m for m in job["members"] if m["role"] == Role.WORKER.value),
                    key=lambda m: member_order(str(m["member_id"])),
                )
                job["ranks"] = [
                    {
                        "rank": i,
                        "member_id": m["member_id"],
                        "node": m["node"],
                        "gpu": m["gpu"],
                        "pid": m.get("pid"),
                    }
                    for i, m in enumerate(workers[: int(job["world_size"])])
                ]
            return True

        job = await self._modify(event.job_id, merge)
        if job is None:
            raise KeyError(event.job_id)
        await self._index_nodes(event.job_id, event.cluster, job["ranks"])
        return job

    async def apply_generation(self, event: GenerationChanged) -> dict[str, Any] | None:
        """Move the job's placements to a newer generation (older ones are only kept)."""
        ranks = [
            {"rank": a.rank, "member_id": a.member_id, "node": a.node, "gpu": a.gpu, "pid": None}
            for a in event.ranks
        ]
        await self._r.hset(
            f"{self._p}:gens:{event.job_id}",
            str(event.generation),
            json.dumps(
                {
                    "generation": event.generation,
                    "ranks": ranks,
                    "reason": event.reason,
                    "migration_id": event.migration_id,
                    "at": event.occurred_at.isoformat(),
                }
            ),
        )
        await self.add_timeline(
            event.job_id,
            event.occurred_at,
            {
                "type": "generation",
                "generation": event.generation,
                "previous": event.previous,
                "reason": event.reason,
                "migration_id": event.migration_id,
                "ranks": [
                    {
                        "rank": r["rank"],
                        "member_id": r["member_id"],
                        "node": r["node"],
                        "gpu": r["gpu"],
                    }
                    for r in ranks
                ],
            },
        )
        applied = False

        def advance(job: dict[str, Any]) -> bool:
            nonlocal applied
            applied = event.generation > int(job["generation"])
            if not applied:
                return False
            pids = {m["member_id"]: m.get("pid") for m in job.get("members", [])}
            job["generation"] = event.generation
            job["ranks"] = [{**r, "pid": pids.get(r["member_id"])} for r in ranks]
            job["world_size"] = len(ranks)
            if job["state"] not in FINISHED_STATES:
                job["state"] = "running"
            return True

        updated = await self._modify(event.job_id, advance)
        if updated is not None and applied:
            await self._index_nodes(event.job_id, updated["cluster"], updated["ranks"])
        return updated

    async def finish(self, event: JobFinished) -> None:
        """Mark a job finished: it no longer has placements a fault could hurt."""

        def end(job: dict[str, Any]) -> bool:
            job["state"] = event.outcome
            job["outcome"] = event.outcome
            job["finished_at"] = event.occurred_at.isoformat()
            return True

        await self._modify(event.job_id, end)
        if event.committed_step is not None:
            await self.record_step(event.job_id, event.committed_step)
        await self._r.srem(f"{self._p}:jobs:active", event.job_id)
        await self.add_timeline(
            event.job_id,
            event.occurred_at,
            {"type": "job_finished", "outcome": event.outcome, "exit_code": event.exit_code},
        )

    async def record_step(self, job_id: str, step: int) -> None:
        """Keep the highest committed step seen for the job."""
        await self._r.eval(
            _MAX_SCRIPT,
            1,
            f"{self._p}:step:{job_id}",
            str(step),
        )

    async def record_pids(self, job_id: str, pids: dict[str, int]) -> None:
        """Fill in process ids learnt from heartbeats (members spawned after registration)."""

        def fill(job: dict[str, Any]) -> bool:
            changed = False
            known = {m["member_id"]: m for m in job["members"]}
            for member_id, pid in pids.items():
                m = known.get(member_id)
                if m is not None and m.get("pid") != pid:
                    m["pid"] = pid
                    changed = True
                elif m is None:
                    job["members"].append(
                        {
                            "member_id": member_id,
                            "role": "spare",
                            "pid": pid,
                            "node": None,
                            "gpu": None,
                        }
                    )
                    changed = True
                for r in job["ranks"]:
                    if r["member_id"] == member_id and r.get("pid") != pid:
                        r["pid"] = pid
                        changed = True
            return changed

        await self._modify(job_id, fill)

    async def _modify(
        self, job_id: str, change: Callable[[dict[str, Any]], bool]
    ) -> dict[str, Any] | None:
        """Read, change and write a job's document as one step; the document, or None.

        Heartbeats (pids), generations and the job's end are handled concurrently and each
        rewrites the whole document: a plain read-then-write let a heartbeat's stale copy
        put the previous generation's placements back over a new one. ``change`` edits the
        document in place and says whether it changed anything; it runs again on a fresh
        read when another writer got in between (WATCH/MULTI).
        """
        key = self._key(job_id)
        async with self._r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        return None
                    job: dict[str, Any] = json.loads(raw)
                    if not change(job):
                        return job
                    pipe.multi()  # type: ignore[no-untyped-call]
                    pipe.set(key, json.dumps(job))
                    await pipe.execute()
                    return job
                except WatchError:
                    continue

    async def add_timeline(self, job_id: str, at: datetime, entry: dict[str, Any]) -> None:
        """Append to the job's timeline; the same entry twice (a redelivery) is stored once."""
        body = json.dumps({"at": at.isoformat(), **entry}, sort_keys=True)
        await self._r.zadd(f"{self._p}:timeline:{job_id}", {body: _ms(at)})

    async def add_timeline_entries(
        self, job_id: str, at: datetime, entries: list[dict[str, Any]]
    ) -> None:
        """Several timeline entries at once (one Redis round trip, one AOF write)."""
        members = {
            json.dumps({"at": at.isoformat(), **e}, sort_keys=True): _ms(at) + i * 1e-3
            for i, e in enumerate(entries)
        }
        await self._r.zadd(f"{self._p}:timeline:{job_id}", members)

    # ------------------------------------------------------------------ reads

    def _key(self, job_id: str) -> str:
        return f"{self._p}:job:{job_id}"

    async def get(self, job_id: str) -> dict[str, Any] | None:
        """The stored job record, or None."""
        raw = await self._r.get(self._key(job_id))
        return None if raw is None else dict(json.loads(raw))

    async def record_step_times(self, job_id: str, total_s: float, steps: int) -> None:
        """Add the agents' step times (their sum over ``steps`` step beats) to the job's."""
        key = f"{self._p}:steptime:{job_id}"
        pipe = self._r.pipeline(transaction=True)
        pipe.hincrbyfloat(key, "total_s", total_s)
        pipe.hincrby(key, "steps", steps)
        await pipe.execute()

    async def step_time(self, job_id: str) -> float | None:
        """The agents' mean step time of the job (seconds), None before any step beat."""
        total, steps = await self._r.hmget(f"{self._p}:steptime:{job_id}", "total_s", "steps")
        if total is None or steps is None or int(steps) <= 0:
            return None
        return float(total) / int(steps)

    async def committed_step(self, job_id: str) -> int | None:
        raw = await self._r.get(f"{self._p}:step:{job_id}")
        return None if raw is None else int(raw)

    async def view(self, job_id: str) -> dict[str, Any] | None:
        """The job as docs/interfaces.md shows it."""
        job = await self.get(job_id)
        if job is None:
            return None
        return {
            "job_id": job["job_id"],
            "tenant": job["tenant"],
            "cluster": job["cluster"],
            "world_size": job["world_size"],
            "spares": job["spares"],
            "generation": job["generation"],
            "committed_step": await self.committed_step(job_id),
            "state": job["state"],
            "policy": job["policy"],
            "ranks": [
                {
                    "rank": r["rank"],
                    "node": r["node"],
                    "gpu": r["gpu"],
                    "pid": r.get("pid"),
                    "member_id": r["member_id"],
                }
                for r in job["ranks"]
            ],
            "registered_at": job["registered_at"],
            "finished_at": job["finished_at"],
        }

    async def list_ids(self) -> list[str]:
        """Every job id, newest registration first."""
        raw = await self._r.zrevrange(f"{self._p}:jobs", 0, -1)
        return [_text(x) for x in raw]

    async def active_placements(
        self, *, job_id: str | None = None, cluster: str | None = None, node: str | None = None
    ) -> list[RankPlacement]:
        """Where every rank of every unfinished job runs now.

        With ``job_id``, only that job is read; with ``cluster`` and ``node``, only the jobs
        that ever had a rank on that node (an index kept per node), so a fault costs what it
        touches rather than a read of every job in the fleet.
        """
        if job_id is not None:
            ids = [job_id]
        elif cluster is not None and node is not None:
            ids = sorted(_text(x) for x in await self._r.smembers(self._node_key(cluster, node)))
        else:
            ids = sorted(_text(x) for x in await self._r.smembers(f"{self._p}:jobs:active"))
        out: list[RankPlacement] = []
        for jid in ids:
            job = await self.get(jid)
            if job is None or job["state"] in FINISHED_STATES:
                continue
            out.extend(
                RankPlacement(
                    job_id=jid,
                    tenant=job["tenant"],
                    cluster=job["cluster"],
                    rank=int(r["rank"]),
                    member_id=r["member_id"],
                    node=r["node"],
                    gpu=int(r["gpu"]),
                    generation=int(job["generation"]),
                )
                for r in job["ranks"]
                if node is None or r["node"] == node
            )
        return out

    def _node_key(self, cluster: str, node: str) -> str:
        return f"{self._p}:node_jobs:{cluster}:{node}"

    async def _index_nodes(self, job_id: str, cluster: str, ranks: list[dict[str, Any]]) -> None:
        # Entries are only added: a reader checks the job's actual placement anyway.
        pipe = self._r.pipeline(transaction=False)
        for n in {r["node"] for r in ranks}:
            pipe.sadd(self._node_key(cluster, n), job_id)
        await pipe.execute()

    async def generations(self, job_id: str) -> list[dict[str, Any]]:
        """Every generation of the job seen so far, oldest first."""
        raw = await self._r.hgetall(f"{self._p}:gens:{job_id}")
        gens = [json.loads(v) for v in raw.values()]
        return sorted(gens, key=lambda g: int(g["generation"]))

    async def timeline(self, job_id: str) -> list[dict[str, Any]]:
        """The job's events in time order."""
        raw = await self._r.zrange(f"{self._p}:timeline:{job_id}", 0, -1)
        return [json.loads(_text(x)) for x in raw]
