"""``python -m services.api``: the portal API process.

Connects to Redis (the token store, prefix ``tr:api``) and NATS first, so a bad
``REDIS_URL``/``NATS_URL`` exits non-zero with a message naming it, then serves the app with
uvicorn on ``TORCHRELAY_HTTP_HOST``/``TORCHRELAY_HTTP_PORT`` (0 picks a free port; the bound
port is printed and logged as ``ready``). The event loop is uvloop's and HTTP is parsed by
httptools when they are installed (both are dependencies; a kept answer costs less than half
the CPU it does on asyncio's loop and h11), else asyncio's loop and h11; each response is
written with one system call (:mod:`services.api.transport`); there is no access log.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator

import uvicorn

from services.api.app import create_app
from services.api.auth import connect_token_redis
from services.api.settings import ApiSettings
from services.api.transport import http_protocol
from torchrelay.bus import Bus, BusError
from torchrelay.observability import configure_logging, configure_tracing
from torchrelay.service import EXIT_CONFIG, EXIT_UNAVAILABLE
from torchrelay.settings import SettingsError, load_settings


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed, else None (asyncio's own)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: ours stops it cleanly and exits 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(
    settings: ApiSettings,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[int], None] | None = None,
) -> None:
    """Run the API until ``stop`` is set or SIGTERM/SIGINT arrives."""
    log = configure_logging("api", settings.log_level, settings.log_json)
    provider = configure_tracing("api", settings.otlp_endpoint)
    redis = await connect_token_redis(settings.redis_url, settings.connect_timeout_s)
    try:
        creds = str(settings.nats_credentials) if settings.nats_credentials else None
        bus = await Bus.connect(
            settings.nats_url, "api", credentials=creds, timeout=settings.connect_timeout_s
        )
    except BaseException:
        await redis.aclose()
        raise
    app = create_app(settings, bus=bus, redis=redis)
    app.state.api.bus.metrics = app.state.api.metrics
    protocol, parser = http_protocol()
    config = uvicorn.Config(
        app,
        host=settings.http_host,
        port=settings.http_port,
        log_config=None,
        access_log=False,
        http=protocol,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    task = asyncio.create_task(server.serve())
    watcher: asyncio.Task[None] | None = None
    try:
        while not server.started:
            if task.done():
                await task
                raise BusError(
                    f"the API could not listen on {settings.http_host}:"
                    f"{settings.http_port}; set TORCHRELAY_HTTP_PORT to a free port"
                )
            await asyncio.sleep(0.02)
        # What exists once the app is up (modules, app, models, connections) lives as long as
        # the process: out of the collector's sight, a full collection walks only what
        # requests made (it walked ~90,000 objects for up to 80 ms, a latency spike for every
        # request in flight).
        gc.freeze()
        port = int(server.servers[0].sockets[0].getsockname()[1])
        url = f"http://{settings.http_host}:{port}"
        log.info(
            "ready",
            extra={
                "http_port": port,
                "api_url": url,
                "pid": os.getpid(),
                "loop": type(loop).__module__.split(".")[0],
                "http": parser,
            },
        )
        print(json.dumps({"service": "api", "http_port": port, "api_url": url}), flush=True)
        if on_ready is not None:
            on_ready(port)
        if stop is not None:

            async def _watch() -> None:
                await stop.wait()
                server.should_exit = True

            watcher = asyncio.create_task(_watch())
        await task
    finally:
        if watcher is not None:
            watcher.cancel()
        if not task.done():
            server.should_exit = True
            with contextlib.suppress(Exception):
                await task
        await bus.close()
        await redis.aclose()
        provider.shutdown()


def main() -> None:
    """Entry point: exit 2 naming a bad setting, 3 naming an unreachable server."""
    try:
        settings = load_settings(ApiSettings)
    except SettingsError as exc:
        print(f"api: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from exc
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(serve(settings))
    except SettingsError as exc:
        print(f"api: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from exc
    except BusError as exc:
        print(f"api: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_UNAVAILABLE) from exc


if __name__ == "__main__":
    main()
