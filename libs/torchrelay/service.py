"""The service runner: settings → connections → handlers → serve, and a clean SIGTERM.

Each control-plane service's ``__main__`` calls :func:`run_service` with a ``setup``
coroutine that registers its consumers and RPC verbs on the :class:`ServiceContext`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from torchrelay.bus import (
    Bus,
    BusError,
    EventHandler,
    RedisDeduper,
    RpcHandler,
    cancel_until_done,
)
from torchrelay.contract import CONSUMERS, ConsumerSpec, Event
from torchrelay.leadership import FencedRedis, LeaderLease, LeaseClock, LeaseLost
from torchrelay.observability import (
    ServiceMetrics,
    configure_logging,
    configure_tracing,
)
from torchrelay.settings import ServiceSettings, SettingsError, load_settings

EXIT_CONFIG = 2
EXIT_UNAVAILABLE = 3
#: A leader that lost its lease exits with this (EX_TEMPFAIL); its supervisor restarts it
#: as a standby, with none of the state it read before.
EXIT_LEASE_LOST = 75

#: Services whose work happens in one replica at a time (docs/design.md §10): the scheduler
#: orders each job's events, the executor drives each saga, billing appends and closes
#: terms. The others share their work across replicas (queue groups, atomic scripts).
ELECTED_SERVICES = frozenset({"scheduler", "migration_executor", "billing"})


@dataclass
class ServiceContext:
    """What a service's handlers get: settings, the bus, Redis, metrics and readiness."""

    name: str
    settings: ServiceSettings
    bus: Bus
    redis: aioredis.Redis
    metrics: ServiceMetrics
    log: logging.Logger
    readiness: dict[str, str] = field(default_factory=dict)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    @property
    def prefix(self) -> str:
        """This service's Redis key prefix; no other service reads under it."""
        return f"tr:{self.name}"

    async def consume(
        self,
        durable: str,
        handler: EventHandler,
        wants: Callable[[Event], bool] | None = None,
    ) -> None:
        """Consume the contract's durable consumer ``durable`` with Redis dedupe.

        ``wants``: see :meth:`Bus.consume` (events this service ignores, acked at once).
        """
        spec: ConsumerSpec = CONSUMERS[durable]
        await self.bus.consume(spec, handler, RedisDeduper(self.redis, self.prefix), wants=wants)

    async def serve(self, verb: str, handler: RpcHandler) -> None:
        """Answer ``tr.rpc.<service>.<verb>``."""
        await self.bus.serve(self.name, verb, handler)

    def spawn(self, coro: Awaitable[Any], name: str) -> None:
        """Run a background task for the service's lifetime (cancelled at shutdown)."""
        self.tasks.append(asyncio.ensure_future(coro))
        self.tasks[-1].set_name(name)


Setup = Callable[[ServiceContext], Awaitable[None]]


class HealthServer:
    """A tiny HTTP server for ``/healthz``, ``/readyz`` and ``/metrics``."""

    def __init__(
        self,
        ctx: ServiceContext | None,
        metrics: ServiceMetrics,
        ready: Callable[[], tuple[bool, dict[str, Any]]],
    ) -> None:
        self._metrics = metrics
        self._ready = ready
        self._server: asyncio.Server | None = None
        self.port = 0
        del ctx

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._on_conn, host, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5.0)
            while (await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b"\n", b""):
                pass
            parts = line.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) > 1 else "/"
            status, ctype, body = self._route(path)
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def _route(self, path: str) -> tuple[str, str, bytes]:
        if path == "/healthz":
            return "200 OK", "application/json", b'{"status":"ok"}'
        if path == "/readyz":
            ok, detail = self._ready()
            # The pid lets a supervisor tell its own process from another on a reused port.
            body = json.dumps({"ready": ok, "pid": os.getpid(), **detail}).encode()
            return ("200 OK" if ok else "503 Service Unavailable"), "application/json", body
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self._metrics.registry)
        return "404 Not Found", "application/json", b'{"error":"not found"}'


#: Connections one service may hold to Redis. Requests beyond it wait for a free one
#: (redis-py's default pool raises "Too many connections" at 100 instead, which turned a
#: burst of RPCs, each handler plus the background work it spawns, into internal errors).
REDIS_MAX_CONNECTIONS = 256


async def connect_redis(
    url: str, timeout: float = 10.0, max_connections: int = REDIS_MAX_CONNECTIONS
) -> aioredis.Redis:
    """Connect to Redis and PING it, retrying until ``timeout``; errors name ``REDIS_URL``.

    The client's pool blocks (up to ``timeout``) for a free connection once
    ``max_connections`` are busy, so a burst queues instead of failing.
    """
    try:
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout
        )
    except ValueError as exc:
        raise SettingsError(f"REDIS_URL {url!r} is malformed: {exc}") from exc
    client: aioredis.Redis = FencedRedis.from_pool(pool)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            await client.ping()
            return client
        except Exception as exc:
            if "auth" in str(exc).lower() or loop.time() > deadline:
                await client.aclose()
                raise BusError(
                    f"REDIS_URL {url} is unreachable ({exc}); start it with "
                    "'torchrelay up' or unset REDIS_URL to use the embedded server"
                ) from exc
            await asyncio.sleep(0.2)


async def serve_service(
    name: str,
    setup: Setup,
    settings: ServiceSettings,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[int], None] | None = None,
) -> None:
    """Run one service until ``stop`` is set (or SIGTERM/SIGINT)."""
    log = configure_logging(name, settings.log_level, settings.log_json)
    provider = configure_tracing(name, settings.otlp_endpoint, trace_file=settings.trace_file)
    metrics = ServiceMetrics(name)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    redis_client = await connect_redis(settings.redis_url, settings.connect_timeout_s)
    creds = str(settings.nats_credentials) if settings.nats_credentials else None
    bus = await Bus.connect(
        settings.nats_url,
        name,
        credentials=creds,
        timeout=settings.connect_timeout_s,
        metrics=metrics,
    )
    ctx = ServiceContext(name, settings, bus, redis_client, metrics, log)
    ready_flag = False

    def ready() -> tuple[bool, dict[str, Any]]:
        ok = ready_flag and bus.nc.is_connected
        return ok, {
            "service": name,
            "nats": "connected" if bus.nc.is_connected else "down",
            "detail": ctx.readiness,
        }

    health = HealthServer(ctx, metrics, ready)
    port = await health.start(settings.http_host, settings.http_port)
    lease: LeaderLease | None = None
    lost: list[str] = []
    try:
        await bus.ensure_provisioned(settings.stream_replicas)
        if name in ELECTED_SERVICES:
            lease = LeaderLease(
                redis_client, f"tr:{name}:leader", LeaseClock(settings.leader_ttl_s)
            )
            # A standby is ready (alive and reachable) with nothing set up yet.
            ctx.readiness["role"] = "standby"
            ready_flag = True
            if not await _lead(lease, stop, log):
                return
            ctx.readiness["role"] = "leader"
            bus.fence = lease.check
            if isinstance(redis_client, FencedRedis):
                redis_client.fence = lease.check

            def _on_lost(why: str) -> None:
                lost.append(why)
                stop.set()

            ctx.spawn(lease.keep(_on_lost), "leader-lease")
        await setup(ctx)
        # Ready means reachable: the server has every subscription the setup made (a
        # request sent the moment readiness shows would otherwise find no responder).
        await bus.confirm(settings.connect_timeout_s)
        ready_flag = True
        log.info("ready", extra={"http_port": port, "pid": os.getpid()})
        if on_ready is not None:
            on_ready(port)
        await stop.wait()
        log.info("stopping")
    finally:
        if lost:
            log.error("lost the leader lease (%s): exiting to restart as a standby", lost[0])
        elif lease is not None and lease.held:
            await lease.release()
        for task in ctx.tasks:
            task.cancel()
        for task in ctx.tasks:
            # A background loop whose cancel() was lost (Python 3.11's wait_for can swallow
            # one, see cancel_until_done) would otherwise hold the stop up for ever.
            await cancel_until_done(task)
        for closer in ctx.closers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(closer(), 2.0)
        await health.close()
        await bus.close()
        await redis_client.aclose()
        provider.shutdown()
    if lost:
        raise LeaseLost(lost[0])


async def _lead(lease: LeaderLease, stop: asyncio.Event, log: logging.Logger) -> bool:
    """Wait as a standby until this replica leads (True) or the service stops (False)."""
    acquiring = asyncio.ensure_future(lease.acquire())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (acquiring, stopping):
            await cancel_until_done(task)
    if not acquiring.done() or acquiring.cancelled():
        return False
    failed = acquiring.exception()
    if failed is not None:
        raise failed  # e.g. the ACL refuses the lease's commands: say so, do not idle
    log.info("leading", extra={"lease": lease.key})
    return True


def run_service(
    name: str, setup: Setup, settings_cls: type[ServiceSettings] = ServiceSettings
) -> None:
    """Entry point of ``python -m services.<name>``: exit non-zero naming a bad setting."""
    try:
        settings = load_settings(settings_cls)
    except SettingsError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from exc
    try:
        asyncio.run(serve_service(name, setup, settings))
    except SettingsError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from exc
    except BusError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_UNAVAILABLE) from exc
    except LeaseLost as exc:
        print(f"{name}: {exc}; exiting to restart as a standby", file=sys.stderr)
        raise SystemExit(EXIT_LEASE_LOST) from exc
