"""Answers of identical list queries, kept for a short time and computed once.

Two hundred dashboards polling ``GET /v1/incidents`` ask the same question many times a
second. Within ``TORCHRELAY_LIST_CACHE_S`` (default 1 s) the API answers a repeated query
from the serialized answer it gave last instead of asking the service, validating and
serializing again; concurrent identical queries share one computation (single-flight).
The key holds the token's scope and tenant, so a tenant never receives an answer made for
another scope. Errors are never kept.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

MAX_ENTRIES = 4096

T = TypeVar("T")


def _always(_value: object) -> bool:
    return True


class ResponseCache(Generic[T]):
    """Answers by key, each kept ``ttl_s`` seconds (0 keeps none), computed once at a time.

    ``keep`` says which answers are kept (the token store keeps known principals only);
    every answer, kept or not, is shared with the callers that waited for it.
    """

    def __init__(
        self,
        ttl_s: float,
        max_entries: int = MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
        keep: Callable[[T], bool] = _always,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._keep = keep
        self._answers: dict[Hashable, tuple[float, T]] = {}
        self._inflight: dict[Hashable, asyncio.Future[T]] = {}

    async def get(self, key: Hashable, make: Callable[[], Awaitable[T]]) -> T:
        """The answer kept for ``key``, or ``make()``'s, shared with concurrent callers.

        ``make``'s exception reaches every caller waiting for it and nothing is kept.
        """
        now = self._clock()
        kept = self._answers.get(key)
        if kept is not None and kept[0] > now:
            return kept[1]
        shared = self._inflight.get(key)
        if shared is None:
            shared = asyncio.ensure_future(self._make(key, make))
            self._inflight[key] = shared
            shared.add_done_callback(functools.partial(self._done, key))
        # shield: one caller going away (client disconnect) must not cancel the others' answer.
        return await asyncio.shield(shared)

    def kept(self, key: Hashable) -> T | None:
        """The answer kept for ``key`` if it is still fresh, else None."""
        kept = self._answers.get(key)
        return kept[1] if kept is not None and kept[0] > self._clock() else None

    def pending(self, key: Hashable) -> asyncio.Future[T] | None:
        """The computation of ``key``'s answer under way, if any (await it shielded)."""
        return self._inflight.get(key)

    async def _make(self, key: Hashable, make: Callable[[], Awaitable[T]]) -> T:
        body = await make()
        if self.ttl_s > 0 and self._keep(body):
            if len(self._answers) >= self.max_entries:
                self._evict()
            self._answers[key] = (self._clock() + self.ttl_s, body)
        return body

    def _done(self, key: Hashable, task: asyncio.Future[T]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved here, so a failure nobody awaited is quiet

    def _evict(self) -> None:
        now = self._clock()
        for key in [k for k, (expires, _) in self._answers.items() if expires <= now]:
            del self._answers[key]
        if len(self._answers) >= self.max_entries:
            self._answers.clear()
