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


class Made:
    """A computation the test releases: ``answers`` in order, counting the calls."""

    def __init__(self, *answers: bytes | None) -> None:
        self.answers = list(answers)
        self.calls = 0
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self) -> bytes | None:
        self.calls += 1
        answer = self.answers.pop(0)
        await self.release.wait()
        if answer is None:
            raise RuntimeError("scheduler down")
        return answer


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_answer_asked_for_near_its_expiry_is_refreshed_in_the_background() -> None:
    clock = Clock()
    cache: ResponseCache[bytes | None] = ResponseCache(1.0, clock=clock, refresh_s=0.25)
    make = Made(b"first", b"second")
    assert await cache.get("k", make) == b"first"
    clock.now += 0.5
    assert cache.kept("k") == b"first"  # outside the refresh window: nothing asked
    await settle()
    assert make.calls == 1
    clock.now += 0.3  # 0.2 s left
    make.release.clear()
    assert cache.kept("k") == b"first"  # answered at once, the refresh started
    assert cache.pending("k") is not None
    assert await cache.get("k", make) == b"first"  # nobody waits for the refresh
    assert cache.kept("k") == b"first"
    make.release.set()
    await settle()
    assert make.calls == 2
    assert cache.kept("k") == b"second"
    clock.now += 0.9  # the new answer's time counts from when its computation started
    assert cache.kept("k") == b"second"
    clock.now += 0.2
    assert cache.kept("k") is None


async def test_a_refresh_that_is_not_kept_drops_the_answer_it_replaces() -> None:
    clock = Clock()
    cache: ResponseCache[bytes | None] = ResponseCache(
        10.0, clock=clock, keep=lambda a: a != b"revoked", refresh_s=2.5
    )
    make = Made(b"known", b"revoked")
    assert await cache.get("token", make) == b"known"
    clock.now += 8.0
    assert cache.kept("token") == b"known"
    await settle()
    assert make.calls == 2
    assert cache.kept("token") is None  # before its 10 s were up


async def test_a_failed_refresh_keeps_the_answer_until_it_expires() -> None:
    clock = Clock()
    cache: ResponseCache[bytes | None] = ResponseCache(1.0, clock=clock, refresh_s=0.25)
    make = Made(b"first", None, b"third")
    assert await cache.get("k", make) == b"first"
    clock.now += 0.8
    assert cache.kept("k") == b"first"
    await settle()
    assert make.calls == 2  # that refresh failed
    make.release.clear()
    assert cache.kept("k") == b"first"  # still in its time; the next hit tries again
    assert cache.pending("k") is not None
    clock.now += 0.3
    assert cache.kept("k") is None  # expired: never answered past its time
    waiting = asyncio.ensure_future(cache.get("k", make))  # joins the refresh under way
    await settle()
    assert not waiting.done()
    make.release.set()
    assert await waiting == b"third"
    assert make.calls == 3


async def test_no_refresh_ahead_by_default_or_outside_a_running_loop() -> None:
    clock = Clock()
    cache: ResponseCache[bytes | None] = ResponseCache(1.0, clock=clock)
    make = Made(b"first", b"second")
    assert await cache.get("k", make) == b"first"
    clock.now += 0.99
    assert cache.kept("k") == b"first"
    await settle()
    assert make.calls == 1


def test_kept_outside_an_event_loop_answers_without_refreshing() -> None:
    clock = Clock()
    cache: ResponseCache[bytes | None] = ResponseCache(1.0, clock=clock, refresh_s=0.5)
    make = Made(b"first")
    assert asyncio.run(cache.get("k", make)) == b"first"
    clock.now += 0.9
    assert cache.kept("k") == b"first"
    assert cache.pending("k") is None


async def test_a_forgotten_key_is_asked_again_and_an_answer_read_before_is_not_kept() -> None:
    cache = ResponseCache(10.0)
    answers = iter([b"before", b"slow, read before the forget", b"after"])
    release = asyncio.Event()

    async def make() -> bytes:
        return next(answers)

    async def slow() -> bytes:
        await release.wait()
        return next(answers)

    assert await cache.get("k", make) == b"before"
    cache.forget("k")
    assert cache.kept("k") is None
    waiting = asyncio.ensure_future(cache.get("k", slow))
    await asyncio.sleep(0)
    cache.forget("k")  # while the lookup is under way
    release.set()
    assert await waiting == b"slow, read before the forget"  # its caller still gets it
    assert cache.kept("k") is None  # but it is not kept
    assert await cache.get("k", make) == b"after"
    assert cache.kept("k") == b"after"
