"""Fixtures of the agent's integration tests: a launched job plus the test executor."""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.helpers.relay import FakeExecutor, LaunchedJob
from torchrelay.bus import Bus

_ids = itertools.count()


class JobRunner:
    """Starts jobs and their executors for one test; stops whatever is left at the end."""

    def __init__(self, bus: Bus, nats_url: str, home: Path) -> None:
        self.bus = bus
        self.nats_url = nats_url
        self.home = home
        self.jobs: list[LaunchedJob] = []
        self.executors: list[FakeExecutor] = []

    async def start(
        self,
        name: str,
        *,
        nproc: int,
        spares: int = 0,
        env: dict[str, str] | None = None,
        auto_replace: bool = True,
        nodes: int = 1,
        script: Path | None = None,
    ) -> tuple[LaunchedJob, FakeExecutor]:
        job_id = f"{name}-{os.getpid()}-{next(_ids)}"
        executor = await FakeExecutor(self.bus, job_id, nproc, auto_replace=auto_replace).start()
        self.executors.append(executor)
        env = {k: v.replace("{job}", job_id) for k, v in (env or {}).items()}
        job = LaunchedJob(
            job_id,
            self.nats_url,
            self.home,
            nproc=nproc,
            spares=spares,
            env=env,
            nodes=nodes,
            **({"script": script} if script is not None else {}),
        )
        self.jobs.append(job)
        return job, executor

    async def close(self) -> None:
        for job in self.jobs:
            job.close()
        for executor in self.executors:
            await executor.stop()


@pytest.fixture
async def runner(bus: Bus, nats_url: str, tmp_path: Path) -> AsyncIterator[JobRunner]:
    r = JobRunner(bus, nats_url, tmp_path)
    yield r
    await r.close()
