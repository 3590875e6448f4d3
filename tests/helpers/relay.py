"""Run real torchrelay jobs in tests without the control plane.

``FakeExecutor`` is not a fake of NATS: it plays the migration executor's part of the job
protocol over the real bus, with the same ``torchrelay.generations`` module the executor
uses. It forms generation 1 from the JOINED reports, and replaces a rank on the test's
command or, with ``auto_replace``, when the launcher reports a lost worker.
``LaunchedJob`` runs ``torchrelay run`` as a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from torchrelay.bus import Bus, StaleRevision
from torchrelay.contract import (
    AgentReport,
    Generation,
    Heartbeat,
    MigrationFailed,
    MigrationMode,
    ReportKind,
    Resolution,
    Role,
    Subjects,
    make_event_id,
)
from torchrelay.generations import Candidate, GenerationWriter, member_order

REPO = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = Path(__file__).with_name("train_mlp.py")


@dataclass
class FakeExecutor:
    """Plays the migration executor for one job (see module docstring)."""

    bus: Bus
    job_id: str
    world_size: int
    auto_replace: bool = True
    reports: list[AgentReport] = field(default_factory=list)
    beats: list[Heartbeat] = field(default_factory=list)
    generations: list[Generation] = field(default_factory=list)
    used: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.writer = GenerationWriter(self.bus, source="test-executor")
        self._changed = asyncio.Event()
        self._subs: list[Any] = []
        self._lock = asyncio.Lock()
        self._waiting: list[tuple[int, str]] = []  # lost ranks no spare had joined to take

    async def start(self) -> FakeExecutor:
        self._subs.append(
            await self.bus.nc.subscribe(Subjects.agent_report(self.job_id), cb=self._on_report)
        )
        self._subs.append(
            await self.bus.nc.subscribe(Subjects.heartbeat(self.job_id), cb=self._on_beat)
        )
        await self.bus.confirm()
        return self

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()

    # ---------------------------------------------------------------- events

    async def _on_beat(self, msg: Msg) -> None:
        self.beats.append(Heartbeat.model_validate_json(msg.data))
        self._changed.set()

    async def _on_report(self, msg: Msg) -> None:
        report = AgentReport.model_validate_json(msg.data)
        self.reports.append(report)
        self._changed.set()
        try:
            async with self._lock:
                await self._react(report)
        except Exception as exc:  # surfaced by the tests through .errors
            self.errors.append(f"{type(exc).__name__}: {exc}")

    async def _react(self, report: AgentReport) -> None:
        if report.kind == ReportKind.JOINED and not self.generations:
            first = await self.writer.form(self.job_id, self.world_size, self.reports)
            if first is not None:
                self.generations.append(first)
                self.used.update(a.member_id for a in first.ranks)
        elif report.kind == ReportKind.JOINED and report.role == Role.SPARE and self._waiting:
            # A rank was lost before any hot spare had joined (the launcher reports a loss
            # within milliseconds; a spare still importing torch joins later): like the
            # executor's ``wait`` policy, the first spare to join takes it.
            rank, reason = self._waiting.pop(0)
            await self._replace(rank, MigrationMode.IMMEDIATE, reason)
        elif report.kind == ReportKind.STATE_LOST:
            # As the executor does: the migration fails over to the restart from the
            # job's checkpoint, which the launcher runs (or, without one, ends the job).
            failed = MigrationFailed(
                event_id=make_event_id("state_lost_failed", self.job_id, report.generation),
                source="test-executor",
                migration_id=make_event_id("migration", self.job_id, report.generation),
                incident_id=make_event_id("incident", self.job_id, report.generation),
                job_id=self.job_id,
                reason=f"the rank's state cannot be restored live: {report.error}",
                fallback=Resolution.CHECKPOINT_RESTART,
            )
            await self.bus.publish(failed, Subjects.MIGRATION_FAILED)
        elif report.kind == ReportKind.WORKER_EXIT:
            self.gone.add(report.member_id)
            if (
                self.auto_replace
                and report.error
                and report.error.startswith("lost")
                and self.generations
            ):
                rank = self.generations[-1].member_rank(report.member_id)
                if rank is not None and not self.spares():
                    self._waiting.append((rank, f"lost {report.member_id}"))
                elif rank is not None:
                    await self._replace(rank, MigrationMode.IMMEDIATE, f"lost {report.member_id}")

    # ---------------------------------------------------------------- commands

    def spares(self) -> list[Candidate]:
        """Hot spares that joined, are alive and hold no rank yet, in member order."""
        joined = [
            r
            for r in self.reports
            if r.kind == ReportKind.JOINED
            and r.role == Role.SPARE
            and r.member_id not in self.used
            and r.member_id not in self.gone
        ]
        joined.sort(key=lambda r: member_order(r.member_id))
        return [Candidate.from_report(r) for r in joined]

    def store_addrs(self) -> dict[str, str]:
        return {
            r.member_id: r.store_addr
            for r in self.reports
            if r.kind == ReportKind.JOINED and r.store_addr
        }

    async def _replace(self, rank: int, mode: MigrationMode, reason: str) -> Generation:
        spares = self.spares()
        if not spares:
            raise RuntimeError(f"no hot spare left to replace rank {rank}")
        spare = spares[0]
        self.used.add(spare.member_id)
        current = self.generations[-1]
        nxt = await self.writer.replace(
            self.job_id,
            rank,
            spare,
            mode=mode,
            store_addrs=self.store_addrs(),
            migration_id=make_event_id("migration", self.job_id, current.generation + 1),
            reason=reason,
        )
        self.generations.append(nxt)
        return nxt

    async def replace(
        self, rank: int, mode: MigrationMode = MigrationMode.IMMEDIATE, reason: str = "test"
    ) -> Generation:
        """Write the next generation with the first free hot spare in ``rank``."""
        async with self._lock:
            for _ in range(3):
                try:
                    return await self._replace(rank, mode, reason)
                except StaleRevision:
                    continue
            raise RuntimeError("generation kept changing under the test executor")

    # ---------------------------------------------------------------- waiting

    async def wait_for(
        self, what: str, predicate: Callable[[], Any], timeout: float = 180.0
    ) -> Any:
        """Wait until ``predicate()`` is truthy (re-checked on every report and beat)."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if self.errors:
                raise AssertionError(f"test executor failed: {self.errors}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"timed out waiting for {what}; reports: "
                    f"{[(r.kind.value, r.member_id) for r in self.reports]}"
                )
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))

    def of(
        self, kind: ReportKind, member_id: str | None = None, generation: int | None = None
    ) -> list[AgentReport]:
        return [
            r
            for r in self.reports
            if r.kind == kind
            and (member_id is None or r.member_id == member_id)
            and (generation is None or r.generation == generation)
        ]

    def step_of(self, member_id: str) -> int:
        steps = [b.step for b in self.beats if b.member_id == member_id]
        return max(steps, default=-1)


class LaunchedJob:
    """``torchrelay run`` of the test script as a subprocess (kill it with :meth:`close`)."""

    def __init__(
        self,
        job_id: str,
        nats_url: str,
        home: Path,
        *,
        nproc: int,
        spares: int,
        env: dict[str, str] | None = None,
        nodes: int = 1,
        script: Path = TRAIN_SCRIPT,
        wait_timeout: float = 30.0,
        node_agents: bool = False,
    ) -> None:
        self.job_id = job_id
        self.home = home
        self.run_dir = home / "runs" / job_id
        self.log = home / f"{job_id}.log"
        full_env = dict(os.environ)
        full_env.update(
            {
                "NATS_URL": nats_url,
                "TORCHRELAY_HOME": str(home),
                "PYTHONPATH": str(REPO),
                # Tests always run the divergence guard: a rank that drifts stops the job at
                # the step it happened, naming the tensor, instead of a digest at the end.
                "TORCHRELAY_VERIFY_EVERY": "1",
            }
        )
        full_env.update(env or {})
        cmd = [
            sys.executable,
            "-m",
            "torchrelay.cli",
            "run",
            "--nproc",
            str(nproc),
            "--spares",
            str(spares),
            "--job-id",
            job_id,
            "--nodes",
            str(nodes),
            "--wait-timeout",
            str(wait_timeout),
            *([] if node_agents else ["--no-node-agents"]),
            str(script),
        ]
        self._out = self.log.open("wb")
        self.proc = subprocess.Popen(
            cmd, env=full_env, stdout=self._out, stderr=subprocess.STDOUT, cwd=home
        )

    async def wait(self, timeout: float = 300.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                self.close()
                raise AssertionError(
                    f"job {self.job_id} did not end in {timeout}s:\n{self.output()[-4000:]}"
                )
            await asyncio.sleep(0.1)
        return int(self.proc.returncode)

    def output(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")

    def digests(self) -> dict[int, str]:
        """rank -> state digest written by the ranks that finished."""
        out: dict[int, str] = {}
        for path in sorted(self.run_dir.glob("*.digest.json")):
            data = json.loads(path.read_text())
            out[int(data["rank"])] = str(data["digest"])
        return out

    def pid_of(self, member_id: str) -> int:
        data = json.loads((self.run_dir / "launcher.json").read_text())
        return int(data["members"][member_id])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
