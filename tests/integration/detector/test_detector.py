"""The detector against real NATS and Redis: telemetry, heartbeats and reports to faults."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from services.detector.agent import NodeAgent
from services.detector.service import INVENTORY_CHUNK, Detector
from tests.integration.detector.conftest import (
    Collector,
    register_job,
    running_detector,
    sample,
    send,
)
from torchrelay.bus import Bus, RpcFailed
from torchrelay.contract import (
    AgentReport,
    DeadLetter,
    FaultAction,
    FaultDetected,
    FaultKind,
    Heartbeat,
    NodeHealth,
    NodeHealthChanged,
    ReportKind,
    Severity,
    Subjects,
    make_event_id,
)
from torchrelay.telemetry import SimBackend


async def job_known(det: Detector, job_id: str, generation: int = 1) -> None:
    """Wait (with a deadline) until the detector's durable consumer has seen the job."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = await det.jobs.ranks(job_id)
        if got is not None and got[0] >= generation:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"detector never learned job {job_id}")


def is_kind(kind: FaultKind, node: str | None = None) -> Any:
    return lambda f: f.kind == kind and (node is None or f.node == node)


async def test_xid_79_yields_exactly_one_fault_within_a_second(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus, faults: Collector
) -> None:
    health = Collector(NodeHealthChanged)
    await bus.subscribe_core(Subjects.NODE_HEALTH, health.on_msg)
    async with running_detector(nats_url, redis_url) as det:
        members = await register_job(bus, "jobx", [("local-0", 0), ("local-0", 1)])
        await job_known(det, "jobx")
        await send(bus, "local-0", [sample("local-0", g) for g in range(2)])
        xid_at = time.time()
        await send(bus, "local-0", [sample("local-0", 1, ts=xid_at, xid=79)], critical=True)
        # The lost GPU keeps reporting lost on every poll: still the same episode.
        for i in range(20):
            await send(
                bus,
                "local-0",
                [sample("local-0", 0), sample("local-0", 1, ts=xid_at + 0.05 * i, gpu_lost=True)],
            )
        # A marker fault on another GPU in a routine batch (critical ones jump the queue):
        # once it is here, every sample above was evaluated.
        await send(bus, "local-0", [sample("local-0", 0, xid=119)])
        await faults.wait_for(is_kind(FaultKind.FIRMWARE_HANG))
        await det.drain()  # every fault still being published is out...
        await bus.confirm()  # ...and has reached this connection
        # The worker on the lost GPU dies too: same failure, and the fault says so.
        await bus.publish(
            AgentReport(
                event_id="exit-w1",
                source="test-launcher",
                job_id="jobx",
                member_id=members[1],
                kind=ReportKind.WORKER_EXIT,
                exit_code=-9,
                node="local-0",
                gpu=1,
            ),
            Subjects.agent_report("jobx"),
        )
        exited = await faults.wait_for(is_kind(FaultKind.WORKER_LOST))

    lost = [f for f in faults.items if f.kind == FaultKind.GPU_LOST]
    assert len(lost) == 1
    f: FaultDetected = lost[0]
    arrived = faults.arrived[faults.items.index(f)]
    assert arrived - xid_at < 1.0
    assert (f.node, f.gpu, f.severity, f.action) == (
        "local-0",
        1,
        Severity.FATAL,
        FaultAction.MIGRATE_NOW,
    )
    assert (f.job_id, f.rank, f.member_id) == ("jobx", 1, members[1])
    assert f.evidence["xid"] == 79
    assert f.fault_id == f.event_id == make_event_id("fault", "local", "local-0", 1, "gpu_lost", 1)
    assert exited[0].evidence["related_fault_id"] == f.fault_id
    quarantined = await health.wait_for(lambda h: h.health == NodeHealth.QUARANTINED)
    assert quarantined[0].node == "local-0"


async def test_a_thousand_samples_of_one_thermal_slowdown_are_one_fault(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus, faults: Collector
) -> None:
    async with running_detector(nats_url, redis_url) as det:
        t0 = time.time() - 1000
        samples = [
            sample(
                "local-1",
                0,
                ts=t0 + i,
                hw_slowdown=True,
                hw_thermal_slowdown=True,
                clock_event_reasons=0x48,
                temperature_c=87,
                temp_slowdown_c=87,
            )
            for i in range(1000)
        ]
        for start in range(0, 1000, 50):
            await send(bus, "local-1", samples[start : start + 50])
        await send(bus, "local-1", [sample("local-1", 1, xid=119)])  # routine: after the rest
        await faults.wait_for(is_kind(FaultKind.FIRMWARE_HANG))
        await det.drain()
        await bus.confirm()
        assert det.m_samples._value.get() >= 1000  # every thermal sample was evaluated
    thermal = [f for f in faults.items if f.kind == FaultKind.THERMAL_SLOWDOWN]
    assert len(thermal) == 1
    assert thermal[0].action == FaultAction.MIGRATE_AT_BOUNDARY
    assert thermal[0].evidence["slowdown_seconds_per_min"] >= 0.6


async def test_malformed_telemetry_is_dead_lettered_and_the_detector_goes_on(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus, faults: Collector
) -> None:
    dlq = Collector(DeadLetter)
    await bus.subscribe_core(Subjects.dlq("detector"), dlq.on_msg)
    async with running_detector(nats_url, redis_url):
        await bus.nc.publish(Subjects.telemetry("local", "local-2"), b"{not json")
        good = sample("local-2", 0).model_dump(mode="json")
        await bus.nc.publish(
            Subjects.telemetry("local", "local-2"),
            (
                '{"event_id": "x", "source": "a", "cluster": "local", "node": "local-2", '
                '"samples": ['
                + str(good)
                .replace("'", '"')
                .replace("None", "null")
                .replace("False", "false")
                .replace("True", "true")
                .replace('"gpu": 0', '"gpu": -3')
                + "]}"
            ).encode(),
        )
        await bus.nc.publish(Subjects.heartbeat("jobz"), b'{"job_id": "jobz"}')
        await send(bus, "local-2", [sample("local-2", 0, xid=79)], critical=True)
        await faults.wait_for(is_kind(FaultKind.GPU_LOST, "local-2"))
        letters = await dlq.wait_for(lambda d: True, count=3)
    reasons = sorted(d.reason for d in letters)
    assert any("invalid TelemetryBatch" in r and "json" in r.lower() for r in reasons)
    assert any("samples.0.gpu" in r for r in reasons)  # the field is named
    assert any("invalid Heartbeat" in r for r in reasons)
    assert {d.subject for d in letters} == {"tr.tel.local.local-2", "tr.hb.jobz"}


async def test_worker_exit_report_is_one_worker_lost(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus, faults: Collector
) -> None:
    async with running_detector(nats_url, redis_url) as det:
        members = await register_job(bus, "jobe", [("local-0", 0), ("local-0", 1), ("local-1", 0)])
        await job_known(det, "jobe")

        def report(member: str, kind: ReportKind, **kw: Any) -> AgentReport:
            return AgentReport(
                event_id=make_event_id(kind.value, member, kw.get("exit_code")),
                source="test-launcher",
                job_id="jobe",
                member_id=member,
                kind=kind,
                node="local-0",
                gpu=0,
                **kw,
            )

        subject = Subjects.agent_report("jobe")
        await bus.publish(report(members[0], ReportKind.WORKER_EXIT, exit_code=75), subject)
        await bus.publish(
            report(members[2], ReportKind.WORKER_EXIT, exit_code=-9, error="killed by signal 9"),
            subject,
        )
        await bus.publish(
            report(members[0], ReportKind.COLLECTIVE_FAILED, peer_rank=2, error="connection reset"),
            subject,
        )
        lost = await faults.wait_for(is_kind(FaultKind.WORKER_LOST))
        await bus.publish(
            report(members[1], ReportKind.APPLICATION_ERROR, rank=1, error="ZeroDivisionError"),
            subject,
        )
        app = await faults.wait_for(is_kind(FaultKind.APPLICATION_ERROR))
    assert len([f for f in faults.items if f.kind == FaultKind.WORKER_LOST]) == 1
    f = lost[0]
    assert "related_fault_id" not in f.evidence  # its GPU did not fail
    assert (f.job_id, f.rank, f.member_id, f.node, f.gpu) == ("jobe", 2, members[2], "local-1", 0)
    assert f.fault_id == make_event_id("worker_lost", "jobe", members[2])
    assert f.evidence["signal"] == "worker_exit"
    assert (app[0].action, app[0].severity, app[0].rank) == (FaultAction.RECORD, Severity.INFO, 1)


async def test_heartbeats_that_stop_are_worker_lost(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus, faults: Collector
) -> None:
    async with running_detector(nats_url, redis_url, detector_heartbeat_timeout_s=1.0) as det:
        members = await register_job(bus, "jobh", [("local-0", 0), ("local-0", 1)])
        await job_known(det, "jobh")
        stop_w1 = asyncio.Event()
        done = asyncio.Event()

        async def beat(member: str, rank: int, stop: asyncio.Event) -> None:
            step = 0
            while not stop.is_set() and not done.is_set():
                step += 1
                await bus.publish_core(
                    Subjects.heartbeat("jobh"),
                    Heartbeat(
                        event_id=f"{member}-{step}",
                        source=member,
                        job_id="jobh",
                        member_id=member,
                        rank=rank,
                        generation=1,
                        step=step,
                        step_time_s=0.1,
                        node="local-0",
                        gpu=rank,
                        pid=1,
                    ),
                )
                await asyncio.sleep(0.1)  # the agent's own beat period

        tasks = [
            asyncio.create_task(beat(members[0], 0, done)),
            asyncio.create_task(beat(members[1], 1, stop_w1)),
        ]
        await asyncio.sleep(0.5)  # both ranks beat for a while (the workload, not a sync)
        stopped_at = time.time()
        stop_w1.set()
        lost = await faults.wait_for(is_kind(FaultKind.WORKER_LOST), timeout=10)
        done.set()
        await asyncio.gather(*tasks)
    f = lost[0]
    detected = faults.arrived[faults.items.index(f)]
    assert (f.member_id, f.rank, f.job_id) == (members[1], 1, "jobh")
    assert f.evidence["signal"] == "heartbeats_gone"
    assert f.evidence["silent_s"] > 1.0  # the timeout
    assert detected - stopped_at < 3.0
    assert [x.member_id for x in faults.items] == [members[1]]  # the live rank is not blamed


async def test_chaos_through_a_simulated_node_agent(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus, faults: Collector
) -> None:
    async with running_detector(nats_url, redis_url):
        agent = NodeAgent(
            bus, "local", "local-5", [SimBackend("local", "local-5", gpus=2)], interval_s=0.2
        )
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        await asyncio.wait_for(agent.ready.wait(), 10)
        try:
            reply = await bus.request(
                Subjects.chaos("local", "local-5"),
                {"fault": "xid", "gpu": 1, "code": 79},
                timeout=5,
            )
            assert reply["fault"] == "xid"
            f = (await faults.wait_for(is_kind(FaultKind.GPU_LOST, "local-5")))[0]
            assert f.gpu == 1
            await bus.request(
                Subjects.chaos("local", "local-5"), {"fault": "remap", "gpu": 0}, timeout=5
            )
            await faults.wait_for(is_kind(FaultKind.ROW_REMAP_PENDING, "local-5"))
            with pytest.raises(RpcFailed) as info:
                await bus.request(
                    Subjects.chaos("local", "local-5"), {"fault": "meteor", "gpu": 0}, timeout=5
                )
            assert info.value.error.field == "fault"
        finally:
            stop.set()
            await task


async def test_node_rpc_and_return_to_service(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus, faults: Collector
) -> None:
    health = Collector(NodeHealthChanged)
    await bus.subscribe_core(Subjects.NODE_HEALTH, health.on_msg)
    async with running_detector(nats_url, redis_url):
        for node in ("n-a", "n-b"):
            await send(
                bus,
                node,
                [sample(node, g, cluster="east", temperature_c=60, power_w=300) for g in range(2)],
                cluster="east",
            )
        await send(
            bus, "n-a", [sample("n-a", 1, cluster="east", xid=119)], critical=True, cluster="east"
        )
        await faults.wait_for(is_kind(FaultKind.FIRMWARE_HANG))
        await health.wait_for(lambda h: h.health == NodeHealth.UNHEALTHY)
        rpc = Subjects.rpc
        clusters = await bus.request(rpc("detector", "cluster_list"), {})
        assert {"cluster": "east", "nodes": 2, "gpus": 4, "unhealthy": 1} in clusters
        nodes = await bus.request(rpc("detector", "node_list"), {"cluster": "east"})
        by_node = {n["node"]: n for n in nodes}
        assert by_node["n-a"]["health"] == "unhealthy"
        assert by_node["n-a"]["state"] == "out_of_service"
        assert by_node["n-a"]["lemon_score"] == 1.0
        assert by_node["n-a"]["gpus"][1]["faults"] == ["firmware_hang"]
        assert by_node["n-b"]["health"] == "healthy"
        one = await bus.request(rpc("detector", "node_get"), {"node": "n-a"})
        assert one["cluster"] == "east"
        assert one["gpus"][0]["temperature_c"] == 60
        with pytest.raises(RpcFailed) as info:
            await bus.request(rpc("detector", "node_get"), {"node": "nope"})
        exc = info.value
        assert exc.error.code == "not_found"
        with pytest.raises(RpcFailed) as info:
            await bus.request(rpc("detector", "node_get"), {"node": "bad node!"})
        exc = info.value
        assert (exc.error.code, exc.error.field) == ("invalid", "node")
        back = await bus.request(rpc("detector", "node_return"), {"node": "n-a"})
        assert (back["health"], back["previous_health"]) == ("healthy", "unhealthy")
        await health.wait_for(lambda h: h.health == NodeHealth.HEALTHY and h.node == "n-a")
        # The same fault again after the return is a repeat: quarantine for inspection.
        await send(
            bus, "n-a", [sample("n-a", 1, cluster="east", xid=119)], critical=True, cluster="east"
        )
        again = await faults.wait_for(is_kind(FaultKind.FIRMWARE_HANG), count=2)
        await health.wait_for(lambda h: h.health == NodeHealth.QUARANTINED)
    assert again[1].repeat == 2
    assert "escalated" in again[1].evidence


async def see_each_other(a: Detector, b: Detector) -> None:
    """Two detector replicas both list the two as members (within 10 s)."""
    deadline = time.monotonic() + 10
    while len(a.membership.replicas) < 2 or len(b.membership.replicas) < 2:
        assert time.monotonic() < deadline, "replicas never saw each other"
        await asyncio.sleep(0.1)


async def test_the_fleet_gauges_count_nodes_and_gpus_by_health_on_one_replica(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus, faults: Collector
) -> None:
    del redis  # flushed: only this test's clusters
    health = Collector(NodeHealthChanged)
    await bus.subscribe_core(Subjects.NODE_HEALTH, health.on_msg)
    async with (
        running_detector(nats_url, redis_url, detector_replica_id="r1") as a,
        running_detector(nats_url, redis_url, detector_replica_id="r2") as b,
    ):
        await see_each_other(a, b)
        for node in ("f-a", "f-b", "f-c"):
            await send(bus, node, [sample(node, g, cluster="fl") for g in range(4)], cluster="fl")
        await send(
            bus, "f-a", [sample("f-a", 1, cluster="fl", xid=119)], critical=True, cluster="fl"
        )
        await faults.wait_for(is_kind(FaultKind.FIRMWARE_HANG))
        await health.wait_for(lambda h: h.health == NodeHealth.UNHEALTHY)
        for det in (a, b):
            await det.drain()
            await det._flush_inventory()
        for det in (a, b):
            await det.refresh_fleet_gauges()

        def value(det: Detector, name: str, state: str) -> float | None:
            labels = {"cluster": "fl", "health": state}
            return det.ctx.metrics.registry.get_sample_value(name, labels)

        counting = [d for d in (a, b) if value(d, "torchrelay_nodes", "healthy") is not None]
        assert len(counting) == 1, "exactly one replica exports the fleet gauges"
        det = counting[0]
        assert (
            value(det, "torchrelay_nodes", "healthy"),
            value(det, "torchrelay_gpus", "healthy"),
        ) == (2, 8)
        assert value(det, "torchrelay_nodes", "unhealthy") == 1
        assert value(det, "torchrelay_gpus", "unhealthy") == 4
        assert value(det, "torchrelay_nodes", "lemon") == 0


async def test_the_periodic_inventory_flush_writes_every_node_of_a_large_fleet(
    nats_url: str, redis_url: str, bus: Bus
) -> None:
    # More nodes than one flush step writes (INVENTORY_CHUNK), in two clusters.
    clusters = ("inv-east", "inv-west")
    nodes = [(f"inv{i}", clusters[i % 2]) for i in range(2 * INVENTORY_CHUNK + 37)]
    async with running_detector(nats_url, redis_url, detector_inventory_interval_s=3600) as det:
        for temperature in (50.0, 71.5):
            for node, cluster in nodes:
                await send(
                    bus,
                    node,
                    [sample(node, g, cluster=cluster, temperature_c=temperature) for g in range(2)],
                    cluster=cluster,
                )
            await bus.confirm()
            deadline = time.monotonic() + 20
            while det.m_samples._value.get() < 2 * len(nodes) * (1 if temperature < 60 else 2):
                assert time.monotonic() < deadline, "the detector did not evaluate every batch"
                await asyncio.sleep(0.05)
            await det.drain()
        await det._flush_inventory()
        listed = [
            n
            for c in clusters
            for n in await bus.request(Subjects.rpc("detector", "node_list"), {"cluster": c})
        ]
    by_node = {(n["cluster"], n["node"]): n for n in listed}
    assert set(by_node) == {(c, n) for n, c in nodes}
    for view in by_node.values():
        assert [g["temperature_c"] for g in view["gpus"]] == [71.5, 71.5]
        assert view["reporting"] is True


async def test_circuit_breaker_refuses_to_take_out_too_much_of_a_cluster(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus, faults: Collector
) -> None:
    health = Collector(NodeHealthChanged)
    await bus.subscribe_core(Subjects.NODE_HEALTH, health.on_msg)
    async with running_detector(nats_url, redis_url, detector_breaker_max_share=0.25):
        nodes = [f"w-{i}" for i in range(4)]
        for node in nodes:
            await send(bus, node, [sample(node, 0, cluster="west")], cluster="west")
        for node in nodes[:2]:
            await send(
                bus, node, [sample(node, 0, cluster="west", xid=79)], critical=True, cluster="west"
            )
        await faults.wait_for(is_kind(FaultKind.GPU_LOST), count=2)
        refused = await health.wait_for(lambda h: "circuit breaker" in h.reason)
    assert len([h for h in health.items if h.health == NodeHealth.QUARANTINED]) == 1
    assert refused[0].health == NodeHealth.HEALTHY  # unchanged
    assert "1 of 4 nodes" in refused[0].reason


async def test_two_replicas_share_telemetry_and_agree_on_episodes(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus, faults: Collector
) -> None:
    async with (
        running_detector(nats_url, redis_url, detector_replica_id="r1") as a,
        running_detector(nats_url, redis_url, detector_replica_id="r2") as b,
    ):
        await see_each_other(a, b)
        nodes = [f"s-{i}" for i in range(12)]
        t = time.time()
        for node in nodes:
            await send(bus, node, [sample(node, 0, ts=t, xid=79)], critical=True)
        for i in range(10):
            for node in nodes:
                await send(bus, node, [sample(node, 0, ts=t + 0.1 * i, gpu_lost=True)])
        await faults.wait_for(is_kind(FaultKind.GPU_LOST), count=len(nodes))
        for node in nodes:
            await send(bus, node, [sample(node, 1, xid=119)])
        await faults.wait_for(is_kind(FaultKind.FIRMWARE_HANG), count=len(nodes))
        await a.drain()
        await b.drain()
        await bus.confirm()
        forwarded = (
            a.m_forwarded.labels("tel")._value.get() + b.m_forwarded.labels("tel")._value.get()
        )
        evaluated = a.m_samples._value.get() + b.m_samples._value.get()
    lost = [f for f in faults.items if f.kind == FaultKind.GPU_LOST]
    assert sorted(f.node for f in lost) == sorted(nodes)  # one per node, never two
    assert forwarded > 0  # the queue group spread batches; owners got them back
    assert evaluated == len(nodes) * 12


async def _beats(
    bus: Bus,
    job: str,
    members: list[str],
    stop: asyncio.Event,
    step_time: dict[int, float],
    frozen: set[int] | None = None,
) -> None:
    """Every rank beats 20 times a second; a frozen rank stays alive but stops committing."""
    step = 0
    frozen = frozen or set()
    while not stop.is_set():
        step += 1
        for rank, member in enumerate(members):
            await bus.publish_core(
                Subjects.heartbeat(job),
                Heartbeat(
                    event_id=f"{member}-{step}",
                    source=member,
                    job_id=job,
                    member_id=member,
                    rank=rank,
                    generation=1,
                    step=5 if rank in frozen and step > 5 else step,
                    step_time_s=step_time.get(rank, 0.05),
                    kind="liveness" if rank in frozen and step > 5 else "step",
                    node="local-0",
                    gpu=rank,
                    pid=1,
                ),
            )
        await asyncio.sleep(0.05)


async def test_a_rank_slower_than_the_others_is_a_straggler(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus, faults: Collector
) -> None:
    async with running_detector(nats_url, redis_url, detector_straggler_sustain_s=1.0) as det:
        members = await register_job(bus, "jobs", [("local-0", g) for g in range(4)])
        await job_known(det, "jobs")
        stop = asyncio.Event()
        task = asyncio.create_task(_beats(bus, "jobs", members, stop, {2: 0.075}))
        try:
            found = await faults.wait_for(is_kind(FaultKind.STRAGGLER), timeout=15)
        finally:
            stop.set()
            await task
    f = found[0]
    assert (f.rank, f.member_id, f.action) == (2, members[2], FaultAction.MIGRATE_AT_BOUNDARY)
    assert f.evidence["ratio"] == pytest.approx(1.5, rel=0.05)
    assert {x.kind for x in faults.items} == {FaultKind.STRAGGLER}


async def test_a_live_rank_without_progress_is_hung(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus, faults: Collector
) -> None:
    async with running_detector(nats_url, redis_url, detector_hang_floor_s=1.0) as det:
        members = await register_job(bus, "jobg", [("local-0", 0), ("local-0", 1)])
        await job_known(det, "jobg")
        stop = asyncio.Event()
        task = asyncio.create_task(_beats(bus, "jobg", members, stop, {}, frozen={1}))
        try:
            found = await faults.wait_for(is_kind(FaultKind.WORKER_HANG), timeout=15)
        finally:
            # What was raised while both ranks still beat: once the beats stop, their silence
            # is a worker_lost the detector may legitimately raise before it is shut down.
            while_beating = [x.kind for x in faults.items]
            stop.set()
            await task
    f = found[0]
    assert (f.rank, f.member_id, f.action) == (1, members[1], FaultAction.MIGRATE_NOW)
    assert f.evidence["step"] == 5
    assert f.evidence["bound_s"] == 1.0  # the floor: this job's steps take 50 ms
    assert while_beating == [FaultKind.WORKER_HANG]


async def test_a_replica_taking_over_does_not_repeat_an_ongoing_episode(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus, faults: Collector
) -> None:
    t = time.time()
    async with running_detector(nats_url, redis_url, detector_replica_id="first") as det:
        await send(bus, "h-0", [sample("h-0", 0, ts=t, gpu_lost=True)])
        await faults.wait_for(is_kind(FaultKind.GPU_LOST))
        await det.drain()
    # A new replica (empty memory) gets the same GPU, still lost, 30 s later in sample time.
    async with running_detector(nats_url, redis_url, detector_replica_id="second") as det:
        for i in range(1, 31):
            await send(bus, "h-0", [sample("h-0", 0, ts=t + i, gpu_lost=True)])
        await send(bus, "h-0", [sample("h-0", 1, ts=t + 31, xid=119)])
        await faults.wait_for(is_kind(FaultKind.FIRMWARE_HANG))
        await det.drain()
        await bus.confirm()
    assert len([f for f in faults.items if f.kind == FaultKind.GPU_LOST]) == 1


async def test_an_xid_whose_owner_died_is_evaluated_by_the_replica_that_got_it(
    nats_url: str, redis_url: str, redis: aioredis.Redis, bus: Bus, faults: Collector
) -> None:
    async with running_detector(nats_url, redis_url, detector_replica_id="alive") as det:
        # A replica that crashed a moment ago: still in the membership, answering nothing.
        await redis.zadd("tr:detector:replicas", {"ghost": time.time() + 60})
        deadline = time.monotonic() + 10
        while "ghost" not in det.membership.replicas:
            assert time.monotonic() < deadline, "membership never saw the ghost replica"
            await asyncio.sleep(0.1)
        node = next(
            f"g-{i}" for i in range(100) if det.membership.owner(f"tr.tel.local.g-{i}") == "ghost"
        )
        await send(bus, node, [sample(node, 0, xid=79)], critical=True)
        found = await faults.wait_for(is_kind(FaultKind.GPU_LOST, node), timeout=5)
    assert found[0].gpu == 0
