"""A service run in the test's own process: its real setup against real NATS and Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchrelay.bus import cancel_until_done
from torchrelay.service import Setup, serve_service
from torchrelay.settings import ServiceSettings


def service_settings(
    nats_url: str, redis_url: str, cls: type[ServiceSettings] = ServiceSettings, **overrides: Any
) -> Any:
    """A service's settings for a test: the test's servers, quiet logs, a 5 s connect."""
    return cls(
        nats_url=nats_url,
        redis_url=redis_url,
        environment="test",
        log_level="WARNING",
        connect_timeout_s=5.0,
        **overrides,
    )


@dataclass
class InProcess:
    """A started service: set ``stop`` to end it; ``task`` ends when it has."""

    name: str
    task: asyncio.Task[None]
    stop: asyncio.Event
    port: int

    async def stopped(self, within_s: float = 30.0) -> None:
        """Ask it to stop and wait; a stop that hangs fails the test, naming the service
        (a silent wait once hid a background task that had lost its cancel())."""
        self.stop.set()
        done, _ = await asyncio.wait({self.task}, timeout=within_s)
        if not done:
            await cancel_until_done(self.task)
            raise AssertionError(f"{self.name} did not stop within {within_s:g} s")
        if not self.task.cancelled() and self.task.exception() is not None:
            raise self.task.exception()  # type: ignore[misc]


async def start_in_process(
    name: str,
    setup: Setup,
    settings: ServiceSettings,
    ready_within_s: float = 30.0,
    on_ready: Callable[[int], None] | None = None,
) -> InProcess:
    """Start ``serve_service`` and return once it is ready (fail naming it otherwise).

    ``on_ready`` is called with the health port at the moment the service says ready.
    """
    stop = asyncio.Event()
    ready = asyncio.Event()
    ports: list[int] = []

    def ready_now(port: int) -> None:
        if on_ready is not None:
            on_ready(port)
        ports.append(port)
        ready.set()

    task = asyncio.create_task(serve_service(name, setup, settings, stop=stop, on_ready=ready_now))
    waiter = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait(
        {waiter, task}, timeout=ready_within_s, return_when=asyncio.FIRST_COMPLETED
    )
    if waiter not in done:
        waiter.cancel()
        if task.done():
            task.result()
        raise AssertionError(f"{name} did not become ready within {ready_within_s:g} s")
    return InProcess(name, task, stop, ports[0])
