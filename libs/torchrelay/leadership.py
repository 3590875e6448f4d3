"""Leader election among a service's replicas: a lease in Redis, fenced by the local clock.

A service whose work must happen in one place (the scheduler orders each job's events, the
executor drives each saga, billing closes terms) runs every replica, but only the one holding
``tr:<service>:leader`` sets up its consumers and verbs; the others stand by and take the
lease when it lapses. docs/design.md §10 gives the reasoning; in short:

- The lease is ``SET NX PX ttl`` with a random owner id, renewed every ``ttl / 4`` by a script
  that extends it only for its owner. A renewal sent at ``t`` makes the lease valid *locally*
  until ``t + ttl * (1 - DRIFT)``: the server's expiry can only be later than that.
- Every effect a leader has (a publish, an ack, a Redis command) first checks that local
  deadline (:meth:`LeaderLease.check`). A replica paused past it (SIGSTOP, a long GC, a
  frozen VM) wakes, fails that check before it acts on anything it read before the pause,
  and exits; its supervisor restarts it as a standby. The standby that took over meanwhile
  waited for the server's expiry, which is after the paused leader's local deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from torchrelay.errors import LeaseLost

log = logging.getLogger(__name__)

__all__ = ["DRIFT", "FencedRedis", "LeaderLease", "LeaseClock", "LeaseLost"]

#: How much faster than the server's clock a replica's clock may run, as a fraction.
DRIFT = 0.1
DEFAULT_TTL_S = 2.0

# Extend the lease only for its owner: a replica that lost it must not extend another's.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass(frozen=True)
class LeaseClock:
    """The pure rule of the local deadline (unit-tested apart from Redis)."""

    ttl_s: float = DEFAULT_TTL_S
    drift: float = DRIFT

    def __post_init__(self) -> None:
        if not 0.1 <= self.ttl_s <= 60:
            raise ValueError(f"leader lease TTL {self.ttl_s} s: give 0.1 to 60 seconds")
        if not 0 <= self.drift < 0.5:
            raise ValueError(f"clock drift {self.drift}: give a fraction below 0.5")

    def valid_until(self, sent_at: float) -> float:
        """The local time until which a grant or renewal sent at ``sent_at`` holds."""
        return sent_at + self.ttl_s * (1.0 - self.drift)

    @property
    def renew_every_s(self) -> float:
        """Renew four times per TTL: three renewals may be lost before it lapses."""
        return self.ttl_s / 4.0

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))


class LeaderLease:
    """One replica's claim on ``key``: acquire, keep renewed, check before every effect."""

    def __init__(
        self,
        redis: aioredis.Redis,
        key: str,
        clock: LeaseClock | None = None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._r = redis
        self.key = key
        self.clock = clock or LeaseClock()
        self.owner = secrets.token_hex(8)
        self._now = now
        self._until = 0.0
        self._lost: str | None = None
        self._renew: Any = redis.register_script(_RENEW)
        self._release: Any = redis.register_script(_RELEASE)

    @property
    def held(self) -> bool:
        """Whether the local deadline has not passed and no renewal was refused."""
        return self._lost is None and self._now() < self._until

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless this replica may act as leader now."""
        if self._lost is not None:
            raise LeaseLost(self._lost)
        now = self._now()
        if now >= self._until:
            self._lost = f"the lease on {self.key} lapsed {now - self._until:.2f} s ago"
            raise LeaseLost(self._lost)

    async def try_acquire(self) -> bool:
        """One attempt to take the lease; True when this replica holds it now."""
        sent = self._now()
        ok = await self._r.set(self.key, self.owner, nx=True, px=self.clock.ttl_ms)
        if ok:
            self._until = self.clock.valid_until(sent)
            self._lost = None
        return bool(ok)

    async def acquire(self, poll_s: float | None = None) -> None:
        """Wait until this replica holds the lease (a standby waits here)."""
        poll = poll_s if poll_s is not None else self.clock.renew_every_s
        while True:
            with contextlib.suppress(aioredis.ConnectionError, aioredis.TimeoutError):
                if await self.try_acquire():
                    return
            await asyncio.sleep(poll)

    async def renew(self) -> bool:
        """Extend the lease; False (and lost for good) when another replica holds it."""
        self.check()
        sent = self._now()
        extended = await self._renew(keys=[self.key], args=[self.owner, self.clock.ttl_ms])
        if not extended:
            self._lost = f"another replica holds {self.key}"
            return False
        if self._lost is None:
            self._until = self.clock.valid_until(sent)
        return True

    async def keep(self, on_lost: Callable[[str], None]) -> None:
        """Renew until lost, then call ``on_lost`` with why (the service exits on it)."""
        while True:
            await asyncio.sleep(self.clock.renew_every_s)
            try:
                if not await self.renew():
                    break
            except LeaseLost:
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Redis unreachable or refusing: keep trying until the local deadline passes.
                log.warning("leader lease %s not renewed: %r", self.key, exc)
        on_lost(self._lost or f"the lease on {self.key} was lost")

    async def release(self) -> None:
        """Give the lease up at a clean stop, so a standby takes over at once."""
        with contextlib.suppress(Exception):
            await self._release(keys=[self.key], args=[self.owner])
        self._lost = "released"


class FencedRedis(aioredis.Redis):
    """A Redis client that checks a fence before every command it sends.

    Scripts and plain commands go through ``execute_command``; pipelines are checked when
    they execute. With no fence set it is a plain client.
    """

    fence: Callable[[], None] | None = None

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if self.fence is not None:
            self.fence()
        return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        if self.fence is not None:
            self.fence()
        pipe = super().pipeline(transaction, shard_hint)
        fence = self.fence
        if fence is not None:
            execute = pipe.execute

            async def fenced_execute(raise_on_error: bool = True) -> Any:
                fence()
                return await execute(raise_on_error)

            pipe.execute = fenced_execute  # type: ignore[method-assign]
        return pipe
