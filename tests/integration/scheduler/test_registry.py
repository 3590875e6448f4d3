"""The job registry's writers against a real Redis: no update of a job's document is lost."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis
import redis.asyncio as aioredis

from services.scheduler.registry import JobRegistry
from torchrelay.contract import (
    GenerationChanged,
    JobPolicy,
    JobRegistered,
    Member,
    RankAssignment,
    Role,
    make_event_id,
)

JOB = "reg-1"
PREFIX = "tr:scheduler"


def registered() -> JobRegistered:
    return JobRegistered(
        event_id=make_event_id("job", JOB),
        source="test",
        job_id=JOB,
        tenant="acme",
        world_size=2,
        spares=0,
        policy=JobPolicy.WAIT,
        launcher_id="launcher-test",
        members=[
            Member(member_id=f"{JOB}-w{i}", role=Role.WORKER, node="local-0", gpu=i, pid=100 + i)
            for i in range(2)
        ],
    )


def generation(number: int, newcomer: str, node: str) -> GenerationChanged:
    return GenerationChanged(
        event_id=make_event_id("gen", JOB, number),
        source="test",
        job_id=JOB,
        generation=number,
        previous=number - 1,
        reason="test",
        migration_id=f"m-{number}",
        ranks=[
            RankAssignment(rank=0, member_id=f"{JOB}-w0", node="local-0", gpu=0),
            RankAssignment(rank=1, member_id=newcomer, node=node, gpu=0),
        ],
    )


async def test_a_write_between_read_and_write_is_kept_and_the_change_redone(
    redis: aioredis.Redis, redis_url: str
) -> None:
    registry = JobRegistry(redis, PREFIX)
    await registry.register(registered())
    key = f"{PREFIX}:job:{JOB}"
    seen: list[int] = []

    def change(job: dict[str, Any]) -> bool:
        seen.append(int(job["generation"]))
        if len(seen) == 1:
            # Another writer (a generation) lands after this read, before this write.
            other = dict(job, generation=2)
            sync = redis_sync(redis_url)
            sync.set(key, json.dumps(other))
            sync.close()
        job["outcome"] = "mine"
        return True

    await registry._modify(JOB, change)
    assert seen == [0, 2]  # the first write was refused; the change ran on the fresh read
    stored = await registry.get(JOB)
    assert stored is not None
    assert (stored["generation"], stored["outcome"]) == (2, "mine")


def redis_sync(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


async def test_heartbeat_pids_never_put_back_the_previous_generation(
    redis: aioredis.Redis,
) -> None:
    # Heartbeats are handled beside the consumer's events: a newcomer's first beats and its
    # generation arrive together. Each writer rewrites the whole document.
    registry = JobRegistry(redis, PREFIX)
    await registry.register(registered())
    newcomer = f"{JOB}-s0"
    beating = True

    async def beats() -> None:
        pid = 1000
        while beating:
            await registry.record_pids(JOB, {newcomer: pid})
            pid += 1

    tasks = [asyncio.create_task(beats()) for _ in range(4)]
    await asyncio.sleep(0.02)
    await registry.apply_generation(generation(2, newcomer, "local-5"))
    await asyncio.sleep(0.02)
    beating = False
    await asyncio.gather(*tasks)
    job = await registry.get(JOB)
    assert job is not None
    assert job["generation"] == 2
    assert [r["node"] for r in job["ranks"]] == ["local-0", "local-5"]
    assert [m["member_id"] for m in job["members"]].count(newcomer) == 1
    assert job["ranks"][1]["pid"] is not None  # learnt from a beat, kept
