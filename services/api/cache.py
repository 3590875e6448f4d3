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
import contextlib
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

    ``keep`` says which answers are kept (the token store keeps known principals only); an
    answer not kept also drops the one it was to replace. Every answer, kept or not, is
    shared with the callers that waited for it. ``refresh_s`` (0: never) is how long before
    its expiry a kept answer that is asked for is computed again in the background.
    """

    def __init__(
        self,
        ttl_s: float,
        max_entries: int = MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
        keep: Callable[[T], bool] = _always,
        refresh_s: float = 0.0,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.refresh_s = refresh_s
        self._clock = clock
        self._keep = keep
        # key -> (expires, answer, how it was made: for the refresh ahead)
        self._answers: dict[Hashable, tuple[float, T, Callable[[], Awaitable[T]]]] = {}
        self._inflight: dict[Hashable, asyncio.Future[T]] = {}
        # key -> computation that was under way when the key was forgotten: its answer,
        # read before, must not be kept.
        self._stale: dict[Hashable, asyncio.Future[T]] = {}

    async def get(self, key: Hashable, make: Callable[[], Awaitable[T]]) -> T:
        """The answer kept for ``key``, or ``make()``'s, shared with concurrent callers.

        ``make``'s exception reaches every caller waiting for it and nothing is kept.
        """
        kept = self._fresh(key)
        if kept is not None:
            return kept[1]
        shared = self._inflight.get(key)
        if shared is None:
            shared = self._start(key, make)
        # shield: one caller going away (client disconnect) must not cancel the others' answer.
        return await asyncio.shield(shared)

    def kept(self, key: Hashable) -> T | None:
        """The answer kept for ``key`` if it is still fresh, else None; in the refresh
        window (and in a running event loop) it also starts the next computation."""
        kept = self._fresh(key)
        return None if kept is None else kept[1]

    def _fresh(self, key: Hashable) -> tuple[float, T, Callable[[], Awaitable[T]]] | None:
        kept = self._answers.get(key)
        if kept is None:
            return None
        left = kept[0] - self._clock()
        if left <= 0:
            return None
        if left < self.refresh_s and key not in self._inflight:
            with contextlib.suppress(RuntimeError):  # no running loop: no refresh ahead
                asyncio.get_running_loop()
                self._start(key, kept[2])
        return kept

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s answer now; one being computed meanwhile is not kept either."""
        self._answers.pop(key, None)
        running = self._inflight.pop(key, None)
        if running is not None:
            self._stale[key] = running

    def pending(self, key: Hashable) -> asyncio.Future[T] | None:
        """The computation of ``key``'s answer under way, if any (await it shielded)."""
        return self._inflight.get(key)

    def _start(self, key: Hashable, make: Callable[[], Awaitable[T]]) -> asyncio.Future[T]:
        shared = asyncio.ensure_future(self._make(key, make))
        self._inflight[key] = shared
        shared.add_done_callback(functools.partial(self._done, key))
        return shared

    async def _make(self, key: Hashable, make: Callable[[], Awaitable[T]]) -> T:
        started = self._clock()
        body = await make()
        if self._stale.get(key) is asyncio.current_task():
            return body  # forgotten while it was computed: answer the waiting callers only
        if self.ttl_s > 0:
            if self._keep(body):
                if len(self._answers) >= self.max_entries and key not in self._answers:
                    self._evict()
                self._answers[key] = (started + self.ttl_s, body, make)
            else:
                self._answers.pop(key, None)
        return body

    def _done(self, key: Hashable, task: asyncio.Future[T]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if self._stale.get(key) is task:
            del self._stale[key]
        if not task.cancelled():
            task.exception()  # retrieved here, so a failure nobody awaited is quiet

    def _evict(self) -> None:
        now = self._clock()
        for key in [k for k, (expires, _, _) in self._answers.items() if expires <= now]:
            del self._answers[key]
        if len(self._answers) >= self.max_entries:
            self._answers.clear()
