"""Helpers of the detector's integration tests: a detector in-process, event collectors."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import pytest
from nats.aio.msg import Msg
from pydantic import BaseModel

from services.detector.service import Detector, DetectorSettings
from tests.helpers.inproc import service_settings, start_in_process
from torchrelay.bus import Bus
from torchrelay.contract import (
    FaultDetected,
    GenerationChanged,
    JobRegistered,
    Member,
    RankAssignment,
    Role,
    Subjects,
    TelemetryBatch,
    TelemetrySample,
    make_event_id,
)
from torchrelay.service import ServiceContext

M = TypeVar("M", bound=BaseModel)


@dataclass
class Collector:
    """Messages of one model received on a subject, with their arrival times."""

    model: type[BaseModel]
    items: list[Any] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_msg(self, msg: Msg) -> None:
        self.items.append(self.model.model_validate_json(msg.data))
        self.arrived.append(time.time())
        self._changed.set()

    async def wait_for(
        self, pred: Callable[[Any], bool], count: int = 1, timeout: float = 10.0
    ) -> list[Any]:
        """Wait until ``count`` items match ``pred``; fail naming what arrived instead."""
        deadline = time.monotonic() + timeout
        while True:
            got = [x for x in self.items if pred(x)]
            if len(got) >= count:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"waited {timeout}s for {count} matching; got {[_short(x) for x in self.items]}"
                )
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)


def _short(x: Any) -> str:
    if isinstance(x, FaultDetected):
        return f"{x.kind.value}@{x.node}/{x.gpu} job={x.job_id} rank={x.rank}"
    return repr(x)[:160]


@pytest.fixture
async def faults(bus: Bus) -> Collector:
    c = Collector(FaultDetected)
    await bus.subscribe_core(Subjects.FAULT_DETECTED, c.on_msg)
    return c


@contextlib.asynccontextmanager
async def running_detector(
    nats_url: str, redis_url: str, **overrides: Any
) -> AsyncIterator[Detector]:
    """Run the detector service in this process until the block ends."""
    settings = service_settings(nats_url, redis_url, DetectorSettings, log_json=False, **overrides)
    holder: list[Detector] = []

    async def setup(ctx: ServiceContext) -> None:
        det = Detector(ctx, settings)
        await det.start()
        holder.append(det)

    service = await start_in_process("detector", setup, settings)
    try:
        yield holder[0]
    finally:
        await service.stopped(within_s=20)


def sample(
    node: str, gpu: int, ts: float | None = None, cluster: str = "local", **fields: Any
) -> TelemetrySample:
    return TelemetrySample(
        cluster=cluster,
        node=node,
        gpu=gpu,
        ts=datetime.fromtimestamp(ts or time.time(), UTC),
        **fields,
    )


async def send(
    bus: Bus,
    node: str,
    samples: list[TelemetrySample],
    *,
    critical: bool = False,
    cluster: str = "local",
) -> None:
    batch = TelemetryBatch(
        event_id=make_event_id("tel", node, time.time_ns()),
        source="test-agent",
        cluster=cluster,
        node=node,
        samples=samples,
        critical=critical,
    )
    # As the node agent does: critical batches on their own subject.
    subject = (Subjects.telemetry_critical if critical else Subjects.telemetry)(cluster, node)
    await bus.publish_core(subject, batch)


async def register_job(
    bus: Bus, job_id: str, slots: list[tuple[str, int]], cluster: str = "local"
) -> list[str]:
    """Publish JobRegistered and generation 1 for workers on ``slots``; returns member ids."""
    members = [
        Member(member_id=f"{job_id}-w{i}", role=Role.WORKER, node=n, gpu=g, pid=1000 + i)
        for i, (n, g) in enumerate(slots)
    ]
    await bus.publish(
        JobRegistered(
            event_id=make_event_id("job", job_id),
            source="test-launcher",
            job_id=job_id,
            tenant="acme",
            cluster=cluster,
            world_size=len(slots),
            spares=0,
            launcher_id="launcher1",
            members=members,
        ),
        Subjects.JOB_REGISTERED,
    )
    await bus.publish(
        GenerationChanged(
            event_id=make_event_id("generation", job_id, 1),
            source="test-executor",
            job_id=job_id,
            generation=1,
            previous=0,
            reason="formed",
            ranks=[
                RankAssignment(rank=i, member_id=m.member_id, node=m.node, gpu=m.gpu)
                for i, m in enumerate(members)
            ],
        ),
        Subjects.GENERATION_CHANGED,
    )
    return [m.member_id for m in members]
