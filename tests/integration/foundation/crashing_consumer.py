"""A consumer process that applies a message's effect, records it as processed, then dies
before acking — the crash window the dedupe exists for. Used by test_bus.py."""

from __future__ import annotations

import asyncio
import os
import sys

import redis.asyncio as aioredis

from torchrelay.bus import Bus, Delivery, RedisDeduper
from torchrelay.contract import ConsumerSpec, Event


async def main(nats_url: str, redis_url: str, durable: str, subject: str) -> None:
    r = aioredis.from_url(redis_url)
    bus = await Bus.connect(nats_url, "crasher")

    class DieAfterMark(RedisDeduper):
        async def mark(self, event_id: str) -> None:
            await super().mark(event_id)
            os._exit(17)  # effects and mark are durable; the ack never happens

    async def handler(event: Event, delivery: Delivery) -> None:
        await r.rpush("effects", event.event_id)

    spec = ConsumerSpec(
        service="test",
        durable=durable,
        filter_subjects=[subject],
        backoff_s=[0.5, 1.0],
        max_deliver=5,
        ack_wait_s=1.0,
    )
    await bus.consume(spec, handler, DieAfterMark(r, "test"))
    await asyncio.sleep(30)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
