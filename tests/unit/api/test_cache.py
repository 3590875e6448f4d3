"""The API's short-lived cache of list answers: kept ttl_s, computed once, errors not kept."""

from __future__ import annotations

import asyncio

import pytest

from services.api.cache import ResponseCache


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_an_answer_is_kept_for_ttl_then_asked_again() -> None:
    clock = Clock()
    cache = ResponseCache(1.0, clock=clock)
    made: list[int] = []

    async def make() -> bytes:
        made.append(1)
        return f"answer {len(made)}".encode()

    assert await cache.get("k", make) == b"answer 1"
    clock.now += 0.9
    assert await cache.get("k", make) == b"answer 1"
    assert await cache.get("other", make) == b"answer 2"  # another key is asked for
    clock.now += 0.2
    assert await cache.get("k", make) == b"answer 3"
    assert len(made) == 3


async def test_concurrent_identical_queries_share_one_computation() -> None:
    cache = ResponseCache(0.0)  # single-flight even when nothing is kept
    started = asyncio.Event()
    release = asyncio.Event()
    calls = 0

    async def make() -> bytes:
        nonlocal calls
        calls += 1
        started.set()
        await release.wait()
        return b"shared"

    waiting = [asyncio.ensure_future(cache.get("k", make)) for _ in range(50)]
    await started.wait()
    release.set()
    assert await asyncio.gather(*waiting) == [b"shared"] * 50
    assert calls == 1
    assert await cache.get("k", make) == b"shared"
    assert calls == 2  # ttl 0: the next query asks again


async def test_an_error_reaches_every_waiter_and_is_not_kept() -> None:
    cache = ResponseCache(60.0)
    fail = True

    async def make() -> bytes:
        await asyncio.sleep(0)
        if fail:
            raise RuntimeError("scheduler down")
        return b"ok"

    results = await asyncio.gather(
        *(cache.get("k", make) for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, RuntimeError) for r in results)
    fail = False
    assert await cache.get("k", make) == b"ok"


async def test_a_caller_cancelled_does_not_cancel_the_others() -> None:
    cache = ResponseCache(1.0)
    release = asyncio.Event()

    async def make() -> bytes:
        await release.wait()
        return b"ok"

    first = asyncio.ensure_future(cache.get("k", make))
    second = asyncio.ensure_future(cache.get("k", make))
    await asyncio.sleep(0)
    first.cancel()
    release.set()
    assert await second == b"ok"
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_a_full_cache_drops_expired_answers_first() -> None:
    clock = Clock()
    cache = ResponseCache(1.0, max_entries=2, clock=clock)

    async def make() -> bytes:
        return b"x"

    await cache.get("a", make)
    clock.now += 2
    await cache.get("b", make)
    await cache.get("c", make)  # full: "a" has expired and goes
    assert set(cache._answers) == {"b", "c"}
