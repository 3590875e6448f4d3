"""The rendezvous of a job across hosts against a real Redis: each host gets one node rank,
and a host that comes twice, late, with another shape or another claim is refused, naming
the problem (``tr.rpc.scheduler.join_host``)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from services.scheduler.hosts import HostRendezvous
from torchrelay.auth import JobCredentialStore
from torchrelay.bus import Conflict
from torchrelay.contract import HostJoin

PREFIX = "tr:scheduler"
CLAIM = "a-claim-of-sixteen-chars"


def join(job: str, node: str, rank: int | None = None, **over: object) -> HostJoin:
    fields: dict[str, object] = {
        "job_id": job,
        "tenant": "acme",
        "node": node,
        "nnodes": 3,
        "nproc_per_node": 2,
        "node_rank": rank,
        "instance": f"i{uuid.uuid4().hex[:12]}",
    }
    fields.update(over)
    return HostJoin.model_validate(fields)


@pytest.fixture
def rendezvous(redis: aioredis.Redis) -> HostRendezvous:
    return HostRendezvous(redis, PREFIX, JobCredentialStore(redis, PREFIX))


def job_id() -> str:
    return f"hj-{uuid.uuid4().hex[:8]}"


async def test_hosts_without_a_rank_get_the_lowest_free_ones(rendezvous: HostRendezvous) -> None:
    job = job_id()
    first = await rendezvous.join(join(job, "gpu-a", 1))
    others = await asyncio.gather(
        rendezvous.join(join(job, "gpu-b")), rendezvous.join(join(job, "gpu-c"))
    )
    assert first.node_rank == 1
    assert sorted(j.node_rank for j in others) == [0, 2]
    assert {j.world_size for j in [first, *others]} == {6}
    last = max([first, *others], key=lambda j: len(j.hosts))
    assert sorted(last.hosts.values()) == ["gpu-a", "gpu-b", "gpu-c"]


async def test_a_retried_join_of_the_same_launcher_gets_the_same_rank(
    rendezvous: HostRendezvous,
) -> None:
    job = job_id()
    req = join(job, "gpu-a")
    assert (await rendezvous.join(req)).node_rank == 0
    assert (await rendezvous.join(req)).node_rank == 0


async def test_a_second_launcher_on_a_host_is_refused(rendezvous: HostRendezvous) -> None:
    job = job_id()
    await rendezvous.join(join(job, "gpu-a"))
    with pytest.raises(Conflict, match=r"host gpu-a already joined as node rank 0"):
        await rendezvous.join(join(job, "gpu-a"))


async def test_a_taken_rank_a_late_host_and_another_shape_are_refused(
    rendezvous: HostRendezvous,
) -> None:
    job = job_id()
    for node in ("gpu-a", "gpu-b", "gpu-c"):
        await rendezvous.join(join(job, node))
    with pytest.raises(Conflict, match=r"node rank 1 is held by host gpu-b"):
        await rendezvous.join(join(job, "gpu-d", 1))
    with pytest.raises(Conflict, match=r"host gpu-d is late \(a job does not grow\)"):
        await rendezvous.join(join(job, "gpu-d"))
    with pytest.raises(Conflict, match=r"the job has --nnodes 3 --nproc-per-node 2"):
        await rendezvous.join(join(job, "gpu-e", nnodes=4))
    with pytest.raises(Conflict, match=r"--node-rank 5 is not below --nnodes 3"):
        await rendezvous.join(join(job_id(), "gpu-a", 5))


async def test_a_claimed_job_refuses_a_host_with_another_claim(
    redis: aioredis.Redis, rendezvous: HostRendezvous
) -> None:
    job = job_id()
    creds = JobCredentialStore(redis, PREFIX)
    await creds.mint(job, "acme", CLAIM)
    assert (await rendezvous.join(join(job, "gpu-a", claim=CLAIM))).node_rank == 0
    with pytest.raises(Conflict, match=r"claim"):
        await rendezvous.join(join(job, "gpu-b", claim="another-claim-of-16-chars"))
    with pytest.raises(Conflict, match=r"must give its claim"):
        await rendezvous.join(join(job, "gpu-c"))
