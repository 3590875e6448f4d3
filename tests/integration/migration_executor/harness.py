"""Test harness: scheduler, executor and spare pool in-process; agents and launcher simulated.

The agents and the launcher are played by the test (JOINED / RESUMED reports, fence and
spawn_spare answers, reading the generations KV), so these tests need no torch. The spare
pool is the real service, run in-process next to the scheduler and the executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from nats.js.api import DeliverPolicy

from services.migration_executor.runner import REPORTS_DURABLE
from services.migration_executor.service import ExecutorSettings
from services.migration_executor.service import setup as executor_setup
from services.scheduler.service import setup as scheduler_setup
from services.spare_pool.service import SparePoolSettings
from services.spare_pool.service import setup as spare_pool_setup
from torchrelay.bus import Bus, NoResponder
from torchrelay.contract import (
    EVENTS_STREAM,
    AgentReport,
    Event,
    FaultAction,
    FaultDetected,
    FaultKind,
    FenceOrder,
    Generation,
    IncidentClosed,
    JobFinished,
    JobPolicy,
    JobRegistered,
    Member,
    ReportKind,
    Role,
    Severity,
    SpareQuarantined,
    SpareReleased,
    SpareReserved,
    SpareSlot,
    Subjects,
    make_event_id,
    model_for_subject,
)
from torchrelay.service import serve_service
from torchrelay.settings import ServiceSettings

DEADLINE_S = 30.0


async def scheduler_rpc(bus: Bus, verb: str, body: dict[str, object]) -> dict[str, object]:
    """One of the scheduler's RPC verbs (``job_get``, ``job_goodput``, ...)."""
    result: dict[str, object] = await bus.request(Subjects.rpc("scheduler", verb), body)
    return result


async def wait_until(
    check: Callable[[], Awaitable[Any]], timeout: float = DEADLINE_S, what: str = "condition"
) -> Any:
    """Poll ``check`` until it returns something truthy, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.05)


class EventTap:
    """Every durable event published during the test, in stream order."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._sub: Any = None

    async def start(self, bus: Bus) -> None:
        async def on_msg(msg: Any) -> None:
            model = model_for_subject(msg.subject)
            if model is not None:
                with contextlib.suppress(Exception):
                    self.events.append(model.model_validate_json(msg.data))

        self._sub = await bus.js.subscribe(
            Subjects.EVENTS_ALL, cb=on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
        )

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    def of(self, kind: type[Event], **match: Any) -> list[Any]:
        return [
            e
            for e in self.events
            if isinstance(e, kind) and all(getattr(e, k) == v for k, v in match.items())
        ]

    async def wait(self, kind: type[Event], timeout: float = DEADLINE_S, **match: Any) -> Any:
        async def check() -> Any:
            found = self.of(kind, **match)
            return found[0] if found else None

        return await wait_until(check, timeout, f"{kind.__name__} {match}")


class SparePoolView:
    """What the real spare pool holds, read through its RPC verbs and its events."""

    def __init__(self, bus: Bus, tap: EventTap) -> None:
        self.bus = bus
        self.tap = tap

    async def register(self, slot: SpareSlot) -> None:
        await self.bus.request(Subjects.rpc("spare_pool", "register"), slot.model_dump(mode="json"))

    async def slot(self, slot_id: str) -> dict[str, Any]:
        got: dict[str, Any] = await self.bus.request(
            Subjects.rpc("spare_pool", "get"), {"slot_id": slot_id}
        )
        return got

    async def in_state(self, state: str) -> list[str]:
        page = await self.bus.request(Subjects.rpc("spare_pool", "list"), {"state": state})
        return [item["slot_id"] for item in page["items"]]

    def reservations(self) -> list[SpareReserved]:
        return self.tap.of(SpareReserved)

    def releases(self) -> list[SpareReleased]:
        return self.tap.of(SpareReleased)

    def quarantines(self) -> list[SpareQuarantined]:
        return self.tap.of(SpareQuarantined)


@dataclass
class SimJob:
    """A job whose agents and launcher are played by the test."""

    bus: Bus
    job_id: str
    world_size: int = 4
    spares: int = 1
    policy: JobPolicy = JobPolicy.WAIT
    wait_timeout_s: float = 60.0
    allow_shrink: bool = False
    tenant: str = "acme"
    fences: list[FenceOrder] = field(default_factory=list)
    spawned: list[dict[str, Any]] = field(default_factory=list)
    auto_join_spawned: bool = True
    _next_spare: int = 0

    def worker(self, i: int) -> Member:
        # Workers round-robin over local-0 and local-1; spares live on local-2.
        return Member(
            member_id=f"{self.job_id}-w{i}",
            role=Role.WORKER,
            node=f"local-{i % 2}",
            gpu=i // 2,
            pid=1000 + i,
        )

    def spare(self, j: int) -> Member:
        return Member(
            member_id=f"{self.job_id}-s{j}", role=Role.SPARE, node="local-2", gpu=j, pid=2000 + j
        )

    def spare_slot(self, j: int) -> SpareSlot:
        m = self.spare(j)
        return SpareSlot(
            slot_id=f"local:{m.node}:{m.gpu}",
            node=m.node,
            gpu=m.gpu,
            state="hot",
            job_id=self.job_id,
            member_id=m.member_id,
        )

    async def serve_launcher(self) -> None:
        """Answer fence orders and spawn_spare requests like the launcher would."""

        async def fence(msg: Any) -> None:
            self.fences.append(FenceOrder.model_validate_json(msg.data))
            await msg.respond(b'{"ok": true, "result": {"killed": true}}')

        async def spawn(msg: Any) -> None:
            import json

            body = json.loads(msg.data)
            j = self.spares + len(self.spawned)
            member_id = f"{self.job_id}-s{j}"
            self.spawned.append({**body, "member_id": member_id})
            await msg.respond(json.dumps({"ok": True, "result": {"member_id": member_id}}).encode())
            if self.auto_join_spawned:
                await self.joined(
                    Member(
                        member_id=member_id,
                        role=Role.SPARE,
                        node=body["node"],
                        gpu=body["gpu"],
                        pid=3000 + j,
                    )
                )

        await self.bus.nc.subscribe(Subjects.fence(self.job_id), cb=fence)
        await self.bus.nc.subscribe(Subjects.launcher(self.job_id, "spawn_spare"), cb=spawn)

    async def register(self) -> None:
        members = [self.worker(i) for i in range(self.world_size)] + [
            self.spare(j) for j in range(self.spares)
        ]
        await self.bus.publish(
            JobRegistered(
                event_id=make_event_id("job", self.job_id),
                source="launcher",
                job_id=self.job_id,
                tenant=self.tenant,
                world_size=self.world_size,
                spares=self.spares,
                policy=self.policy,
                wait_timeout_s=self.wait_timeout_s,
                allow_shrink=self.allow_shrink,
                launcher_id="test",
                members=members,
            ),
            Subjects.JOB_REGISTERED,
        )

    async def joined(self, m: Member) -> None:
        await self.bus.publish(
            AgentReport(
                event_id=make_event_id("joined", m.member_id),
                source="agent",
                job_id=self.job_id,
                member_id=m.member_id,
                kind=ReportKind.JOINED,
                role=m.role,
                node=m.node,
                gpu=m.gpu,
                pid=m.pid,
                store_addr=f"127.0.0.1:{40000 + (m.pid or 0)}",
            ),
            Subjects.agent_report(self.job_id),
        )

    async def generation(self, at_least: int, timeout: float = DEADLINE_S) -> Generation:
        async def check() -> Generation | None:
            got = await self.bus.get_generation(self.job_id)
            return got[0] if got and got[0].generation >= at_least else None

        gen: Generation = await wait_until(
            check, timeout, f"generation {at_least} of {self.job_id}"
        )
        return gen

    async def resumed(
        self,
        gen: Generation,
        figures: dict[str, dict[str, Any]] | None = None,
        only: set[str] | None = None,
    ) -> None:
        """Every rank of ``gen`` reports RESUMED (with the given figures per member)."""
        for a in gen.ranks:
            if only is not None and a.member_id not in only:
                continue
            f = (figures or {}).get(a.member_id, {})
            await self.bus.publish(
                AgentReport(
                    event_id=make_event_id("resumed", a.member_id, gen.generation),
                    source="agent",
                    job_id=self.job_id,
                    member_id=a.member_id,
                    kind=ReportKind.RESUMED,
                    rank=a.rank,
                    generation=gen.generation,
                    step=f.get("step", 10),
                    stall_ms=f.get("stall_ms", 0.0),
                    lost_steps=f.get("lost_steps", 0),
                    bytes_received=f.get("bytes_received", 0),
                    node=a.node,
                    gpu=a.gpu,
                ),
                Subjects.agent_report(self.job_id),
            )

    async def report_burst(self, n: int, tag: str = "burst") -> None:
        """``n`` COLLECTIVE_FAILED reports at once (a big job's survivors after a failure)."""
        await asyncio.gather(
            *(
                self.bus.publish(
                    AgentReport(
                        event_id=make_event_id(tag, self.job_id, i),
                        source="agent",
                        job_id=self.job_id,
                        member_id=f"{self.job_id}-w{i % self.world_size}",
                        kind=ReportKind.COLLECTIVE_FAILED,
                        rank=i % self.world_size,
                        generation=1,
                        error="peer closed",
                    ),
                    Subjects.agent_report(self.job_id),
                )
                for i in range(n)
            )
        )

    async def reports_drained(self, timeout: float = 120.0) -> None:
        """Wait until the executor's reports consumer holds nothing (a burst is not left to
        the next test, whose reports would queue behind it)."""

        async def drained() -> bool:
            info = await self.bus.js.consumer_info(EVENTS_STREAM.name, REPORTS_DURABLE)
            return not info.num_pending and not info.num_ack_pending

        await wait_until(drained, timeout, "the executor's reports consumer to drain")

    async def finished(
        self, outcome: Literal["succeeded", "failed", "cancelled"], exit_code: int
    ) -> None:
        """The launcher says the job ended."""
        await self.bus.publish(
            JobFinished(
                event_id=f"fin-{self.job_id}",
                source="launcher",
                job_id=self.job_id,
                tenant=self.tenant,
                outcome=outcome,
                exit_code=exit_code,
            ),
            Subjects.JOB_FINISHED,
        )

    async def start(self, timeout: float = DEADLINE_S) -> Generation:
        """Register, join every member and resume generation 1: a running job."""
        await self.serve_launcher()
        await self.register()
        for j in range(self.spares):
            # As the launcher does (docs/design.md §1, "Hosts"): each hot spare is offered to
            # the pool.
            with contextlib.suppress(NoResponder):
                await self.bus.request(
                    Subjects.rpc("spare_pool", "register"),
                    self.spare_slot(j).model_dump(mode="json"),
                )
        for i in range(self.world_size):
            await self.joined(self.worker(i))
        for j in range(self.spares):
            await self.joined(self.spare(j))
        gen = await self.generation(1, timeout)
        await self.resumed(gen)
        return gen

    def fault(
        self,
        kind: FaultKind = FaultKind.WORKER_LOST,
        *,
        rank: int | None = None,
        node: str | None = None,
        gpu: int | None = None,
        severity: Severity = Severity.FATAL,
        action: FaultAction = FaultAction.MIGRATE_NOW,
        with_job: bool = True,
        fault_id: str | None = None,
    ) -> FaultDetected:
        member = self.worker(rank) if rank is not None else None
        fid = fault_id or make_event_id(
            kind.value, self.job_id, member.member_id if member else node, gpu
        )
        return FaultDetected(
            event_id=make_event_id("fault", fid),
            source="detector",
            fault_id=fid,
            cluster="local",
            node=node or (member.node if member else "local-0"),
            gpu=gpu if gpu is not None else (member.gpu if member else None),
            job_id=self.job_id if with_job and member else None,
            rank=rank if with_job else None,
            member_id=member.member_id if with_job and member else None,
            kind=kind,
            severity=severity,
            action=action,
        )


@contextlib.asynccontextmanager
async def control_plane(
    nats_url: str,
    redis_url: str,
    *,
    scheduler: bool = True,
    executor: bool = True,
    spare_pool: bool = True,
    **executor_overrides: Any,
) -> AsyncIterator[None]:
    """The scheduler, the executor and the spare pool in this process until the block ends."""
    common = {
        "nats_url": nats_url,
        "redis_url": redis_url,
        "environment": "test",
        "log_level": "WARNING",
        "connect_timeout_s": 5.0,
    }
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    ready: list[asyncio.Event] = []

    def start(name: str, setup: Any, settings: ServiceSettings) -> None:
        flag = asyncio.Event()
        ready.append(flag)
        tasks.append(
            asyncio.create_task(
                serve_service(name, setup, settings, stop=stop, on_ready=lambda _port: flag.set())
            )
        )

    if spare_pool:
        start("spare_pool", spare_pool_setup, SparePoolSettings(**common))
    if scheduler:
        start("scheduler", scheduler_setup, ServiceSettings(**common))
    if executor:
        timing = {
            "resume_timeout_s": 10.0,
            "join_timeout_s": 10.0,
            "reserve_timeout_s": 5.0,
            "retry_s": 0.2,
            "poll_s": 0.05,
            "rpc_timeout_s": 2.0,
        }
        timing.update(executor_overrides)
        start("migration_executor", executor_setup, ExecutorSettings(**common, **timing))
    try:
        for flag, task in zip(ready, tasks, strict=True):
            waiter = asyncio.create_task(flag.wait())
            done, _ = await asyncio.wait(
                {waiter, task}, timeout=30, return_when=asyncio.FIRST_COMPLETED
            )
            if task in done:
                waiter.cancel()
                task.result()  # raises the service's start-up error
            assert waiter in done, "service did not become ready in 30 s"
        yield
    finally:
        stop.set()
        for task in tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 15)


def executor_process(nats_url: str, redis_url: str, **env: str) -> subprocess.Popen[bytes]:
    """``python -m services.migration_executor`` as its own process."""
    full = dict(os.environ)
    full.update(
        {
            "NATS_URL": nats_url,
            "REDIS_URL": redis_url,
            "TORCHRELAY_ENVIRONMENT": "test",
            "TORCHRELAY_LOG_LEVEL": "WARNING",
            "TORCHRELAY_POLL_S": "0.05",
            "TORCHRELAY_RETRY_S": "0.2",
            "TORCHRELAY_RESUME_TIMEOUT_S": "20",
        }
    )
    full.update(env)
    return subprocess.Popen(
        [sys.executable, "-m", "services.migration_executor"],
        env=full,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def incident_closed(
    tap: EventTap,
    job_id: str,
    timeout: float = DEADLINE_S,
) -> IncidentClosed:
    async def check() -> IncidentClosed | None:
        found = [e for e in tap.of(IncidentClosed) if e.incident.job_id == job_id]
        return found[0] if found else None

    closed: IncidentClosed = await wait_until(check, timeout, f"IncidentClosed of {job_id}")
    return closed
