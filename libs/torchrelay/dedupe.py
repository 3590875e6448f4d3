"""Consumers' memory of the events they have processed (JetStream is at-least-once)."""

from __future__ import annotations

from typing import Any, Protocol


class Deduper(Protocol):
    """Remembers the ``event_id``s a consumer has fully processed."""

    async def seen(self, event_id: str) -> bool: ...

    async def mark(self, event_id: str) -> None: ...


class RedisDeduper:
    """Processed event ids in Redis under the service's own prefix, kept for ``ttl_s``."""

    def __init__(self, redis: Any, prefix: str, ttl_s: int = 7 * 24 * 3600) -> None:
        self._redis = redis
        self._prefix = prefix
        self._ttl = ttl_s

    async def seen(self, event_id: str) -> bool:
        return bool(await self._redis.exists(f"{self._prefix}:seen:{event_id}"))

    async def mark(self, event_id: str) -> None:
        await self._redis.set(f"{self._prefix}:seen:{event_id}", b"1", ex=self._ttl)


class MemoryDeduper:
    """In-process dedupe, for processes without Redis (node agents, tools)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._seen: dict[str, None] = {}
        self._capacity = capacity

    async def seen(self, event_id: str) -> bool:
        return event_id in self._seen

    async def mark(self, event_id: str) -> None:
        self._seen[event_id] = None
        if len(self._seen) > self._capacity:
            self._seen.pop(next(iter(self._seen)))


__all__ = ["Deduper", "MemoryDeduper", "RedisDeduper"]
