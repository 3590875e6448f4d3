"""A connect attempt that swallows a cancellation is still stopped at the deadline."""

from __future__ import annotations

import asyncio

from torchrelay.bus import cancel_until_done


async def test_a_task_that_swallows_cancellations_is_cancelled_until_it_ends() -> None:
    swallowed = 0

    async def stubborn_retry_loop() -> str:
        # What nats-py's connect loop does when wait_for turns a cancel into OSError.
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed < 2:
                    swallowed += 1
                    continue
                raise

    task = asyncio.ensure_future(stubborn_retry_loop())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_until_done(task), timeout=5)
    assert task.cancelled()
    assert swallowed == 2


async def test_a_finished_task_is_left_as_it_is() -> None:
    async def refused() -> None:
        raise OSError("connection refused")

    task = asyncio.ensure_future(refused())
    await asyncio.wait({task})
    await cancel_until_done(task)
    assert isinstance(task.exception(), OSError)
