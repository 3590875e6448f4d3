"""The agent's NATS side: one background thread with its own asyncio loop.

The training thread hands it reports and heartbeats without waiting, and learns about new
generations through a callback; it blocks on the network only where a step must wait.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import nats.errors
import nats.js.errors

from torchrelay.bus import Bus
from torchrelay.contract import GENERATIONS_BUCKET, Event, Generation, Message

log = logging.getLogger("torchrelay.agent")

T = TypeVar("T")

POLL_INTERVAL_S = 2.0  # belt and braces next to the KV watch (e.g. across a reconnect)


class NetThread:
    """A daemon thread running an asyncio loop with a bus connection of this member."""

    def __init__(
        self, url: str, name: str, credentials: str | None = None, connect_timeout: float = 30.0
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="torchrelay-net", daemon=True)
        self._thread.start()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._pending_lock = threading.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self.bus: Bus = self.call(
            Bus.connect(url, name, credentials=credentials, timeout=connect_timeout),
            connect_timeout + 5,
        )

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; the caller may wait on the returned future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait up to ``timeout`` seconds for its result."""
        return self.submit(coro).result(timeout)

    def fire(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` without waiting; :meth:`flush` waits for everything fired."""
        fut = self.submit(coro)
        with self._pending_lock:
            self._pending.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._pending_lock:
            self._pending.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("torchrelay agent: publish failed: %r", fut.exception())

    def publish(self, event: Event, subject: str) -> None:
        """Publish a durable event in the background."""
        self.fire(self.bus.publish(event, subject, retry_for=20.0))

    def publish_core(self, subject: str, message: Message) -> None:
        """Publish a loss-tolerant message in the background (heartbeats)."""
        self.fire(self.bus.publish_core(subject, message))

    def flush(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for every fired publish to finish."""
        with self._pending_lock:
            pending = list(self._pending)
        if pending:
            concurrent.futures.wait(pending, timeout)
        with contextlib.suppress(Exception):
            self.call(self.bus.nc.flush(timeout=max(1, int(timeout))), timeout + 1)

    def start_every(self, interval_s: float, action: Callable[[], None]) -> None:
        """Call ``action`` on the loop every ``interval_s`` seconds (liveness beats)."""

        async def _every() -> None:
            while True:
                try:
                    action()
                except Exception as exc:
                    log.warning("torchrelay agent: periodic action failed: %r", exc)
                await asyncio.sleep(interval_s)

        self._loop.call_soon_threadsafe(
            lambda: self._tasks.append(self._loop.create_task(_every()))
        )

    def watch_generation(self, job_id: str, on_generation: Callable[[Generation], None]) -> None:
        """Call ``on_generation`` (on this thread) for the job's current and every new
        generation; a periodic read covers updates a broken watch would miss."""

        async def _watch_job_subject() -> None:
            # A job-scoped credential may not create consumers: a core subscription on the
            # key's subject sees the executor's puts live.
            async def _on(msg: Any) -> None:
                op = (msg.headers or {}).get("KV-Operation")
                if not msg.data or op in ("DEL", "PURGE"):
                    return
                try:
                    on_generation(Generation.model_validate_json(msg.data))
                except Exception as exc:
                    log.warning("torchrelay agent: bad generation on %s: %r", msg.subject, exc)

            sub = await self.bus.nc.subscribe(f"$KV.{GENERATIONS_BUCKET}.{job_id}", cb=_on)
            try:
                found = await self.bus.get_generation(job_id)
                if found is not None:
                    on_generation(found[0])
                await asyncio.Event().wait()
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

        async def _watch() -> None:
            if self.bus.job_id is not None:
                await _watch_job_subject()
                return
            while True:
                try:
                    kv = await self.bus.generations()
                    watcher = await kv.watch(job_id)
                    async for entry in watcher:
                        if entry is None or not entry.value:
                            continue
                        on_generation(Generation.model_validate_json(entry.value))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("torchrelay agent: generation watch broke (%r); retrying", exc)
                    await asyncio.sleep(0.5)

        async def _poll() -> None:
            while True:
                await asyncio.sleep(POLL_INTERVAL_S)
                try:
                    found = await self.bus.get_generation(job_id)
                except (nats.errors.Error, nats.js.errors.Error, OSError, TimeoutError):
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("torchrelay agent: reading the generation failed: %r", exc)
                    continue
                if found is not None:
                    on_generation(found[0])

        def _start() -> None:
            self._tasks.append(self._loop.create_task(_watch()))
            self._tasks.append(self._loop.create_task(_poll()))

        self._loop.call_soon_threadsafe(_start)

    def close(self, timeout: float = 5.0) -> None:
        """Flush, close the connection and stop the loop."""
        self.flush(timeout)

        async def _close() -> None:
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self.bus.close()

        with contextlib.suppress(Exception):
            self.call(_close(), timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)


__all__ = ["NetThread"]
