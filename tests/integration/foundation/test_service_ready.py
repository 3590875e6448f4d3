"""A service says it is ready only once the server has its subscriptions."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from torchrelay.bus import Bus
from torchrelay.contract import Subjects
from torchrelay.service import ServiceContext, serve_service
from torchrelay.settings import ServiceSettings


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

    settings = ServiceSettings(
        nats_url=nats_url,
        redis_url=redis_url,
        environment="test",
        log_level="WARNING",
        connect_timeout_s=5.0,
    )
    stop = asyncio.Event()
    ready = asyncio.Event()

    def on_ready(_port: int) -> None:
        events.append("ready")
        ready.set()

    task = asyncio.create_task(
        serve_service("probe", setup, settings, stop=stop, on_ready=on_ready)
    )
    try:
        await asyncio.wait_for(ready.wait(), 30)
        assert events[:3] == ["subscribed", "confirmed", "ready"], events
        # And a request sent the moment readiness shows is answered.
        assert await bus.request(Subjects.rpc("probe", "echo"), {"n": 1}, timeout=5) == {"n": 1}
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
