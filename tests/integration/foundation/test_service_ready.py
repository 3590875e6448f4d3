"""A service says it is ready only once the server has its subscriptions, and stops."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.helpers.inproc import service_settings, start_in_process
from torchrelay.bus import Bus
from torchrelay.contract import Subjects
from torchrelay.service import ServiceContext


async def test_ready_is_announced_after_the_server_confirmed_the_setups_subscriptions(
    nats_url: str, redis_url: str, bus: Bus
) -> None:
    events: list[str] = []

    async def echo(body: dict[str, Any]) -> dict[str, Any]:
        return body

    async def setup(ctx: ServiceContext) -> None:
        confirm = ctx.bus.confirm

        async def recorded_confirm(*args: Any, **kwargs: Any) -> None:
            # Bus.confirm, not a bare nc.flush(): see test_bus's wire-order test.
            await confirm(*args, **kwargs)
            events.append("confirmed")

        ctx.bus.confirm = recorded_confirm  # type: ignore[method-assign]
        await ctx.serve("echo", echo)
        events.append("subscribed")

    service = await start_in_process(
        "probe",
        setup,
        service_settings(nats_url, redis_url),
        on_ready=lambda _port: events.append("ready"),
    )
    try:
        assert events[:3] == ["subscribed", "confirmed", "ready"], events
        # And a request sent the moment readiness shows is answered.
        assert await bus.request(Subjects.rpc("probe", "echo"), {"n": 1}, timeout=5) == {"n": 1}
    finally:
        await service.stopped()


async def test_a_background_task_that_loses_a_cancel_does_not_hold_the_stop_up(
    nats_url: str, redis_url: str
) -> None:
    """On Python 3.11 ``asyncio.wait_for`` can swallow a cancellation that lands as its inner
    call completes; a service's background loop that saw that must still end at stop."""
    cancels: list[int] = []

    async def loop_that_loses_one_cancel() -> None:
        while True:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                cancels.append(1)
                if len(cancels) >= 2:
                    raise

    async def setup(ctx: ServiceContext) -> None:
        ctx.spawn(loop_that_loses_one_cancel(), "sweeper-like")

    service = await start_in_process("stubborn", setup, service_settings(nats_url, redis_url))
    service.stop.set()
    task = service.task
    done, _ = await asyncio.wait({task}, timeout=10)
    if not done:
        task.cancel()
    assert done, "the service did not stop: its background task lived through one cancel()"
    assert len(cancels) == 2
