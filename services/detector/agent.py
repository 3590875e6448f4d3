"""The node agent: reads GPU telemetry on one node and publishes it for the detector.

A polling loop publishes one ``TelemetryBatch`` per interval on ``tr.tel.<cluster>.<node>``
(core NATS). Each backend also gets an event thread blocked in ``wait_events``: XIDs and
other critical events are published the moment they arrive, as a batch with
``critical=True`` on ``tr.crit.<cluster>.<node>``. With the simulator backend the agent
answers live fault injection on ``tr.ctl.chaos.<cluster>.<node>``
(``torchrelay chaos xid|ecc|thermal|remap|nvlink|slow``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import threading
import uuid
from collections.abc import Sequence

from nats.aio.msg import Msg
from pydantic import ValidationError

from torchrelay.bus import Bus, BusError, validation_message
from torchrelay.contract import RpcError, RpcReply, Subjects, TelemetryBatch, TelemetrySample
from torchrelay.observability import configure_logging
from torchrelay.settings import CommonSettings, SettingsError, load_settings
from torchrelay.telemetry import (
    BACKENDS,
    ChaosRequest,
    SimBackend,
    TelemetryBackend,
    load_backends,
)

log = logging.getLogger("torchrelay.detector.agent")

MAX_BATCH = 4096
EXIT_NO_BACKEND = 3


class NodeAgent:
    """Publishes one node's telemetry from one or more backends.

    Args:
        bus: a connected bus.
        cluster: the cluster name (subject token).
        node: this node's name (subject token).
        backends: loaded telemetry backends.
        interval_s: seconds between polls.
        event_timeout_s: how long each event thread blocks per wait (bounds shutdown time).
    """

    def __init__(
        self,
        bus: Bus,
        cluster: str,
        node: str,
        backends: Sequence[TelemetryBackend],
        interval_s: float = 1.0,
        event_timeout_s: float = 0.5,
    ) -> None:
        self.bus = bus
        self.cluster = cluster
        self.node = node
        self.backends = list(backends)
        self.interval_s = interval_s
        self.event_timeout_s = event_timeout_s
        self.subject = Subjects.telemetry(cluster, node)
        self.critical_subject = Subjects.telemetry_critical(cluster, node)
        self._halt = threading.Event()
        self._poll_now = asyncio.Event()
        self.ready = asyncio.Event()  # set once polling and the chaos subscription run
        self.published_batches = 0

    @property
    def simulator(self) -> SimBackend | None:
        """The first simulator backend (the one chaos requests go to), if any."""
        return next((b for b in self.backends if isinstance(b, SimBackend)), None)

    async def publish(self, samples: list[TelemetrySample], *, critical: bool) -> None:
        """Publish samples as batches of at most 4,096 (the contract's limit)."""
        for start in range(0, len(samples), MAX_BATCH):
            batch = TelemetryBatch(
                event_id=uuid.uuid4().hex,
                source=f"detector-agent:{self.node}",
                cluster=self.cluster,
                node=self.node,
                samples=samples[start : start + MAX_BATCH],
                critical=critical,
            )
            # Critical events go on their own subject: they never queue behind routine batches.
            await self.bus.publish_core(self.critical_subject if critical else self.subject, batch)
            self.published_batches += 1

    def _event_thread(self, backend: TelemetryBackend, loop: asyncio.AbstractEventLoop) -> None:
        while not self._halt.is_set():
            try:
                events = backend.wait_events(self.event_timeout_s)
            except Exception:
                log.exception("%s: waiting for events failed; retrying", backend.name)
                self._halt.wait(1.0)
                continue
            if events and not self._halt.is_set():
                fut = asyncio.run_coroutine_threadsafe(self.publish(events, critical=True), loop)
                try:
                    fut.result(timeout=5.0)
                except Exception as exc:
                    log.warning("publishing %d critical events failed: %r", len(events), exc)

    async def _on_chaos(self, msg: Msg) -> None:
        sim = self.simulator
        try:
            body = json.loads(msg.data or b"{}")
            req = ChaosRequest.model_validate(body)
            if sim is None:
                raise ValueError(
                    f"node {self.node} runs no simulator backend; chaos needs --backend sim"
                )
            result = sim.inject(req)
            reply = RpcReply(ok=True, result=result)
            log.warning("chaos: %s", result)
            self._poll_now.set()
        except ValidationError as exc:
            text, field = validation_message(exc)
            reply = RpcReply(ok=False, error=RpcError(code="invalid", message=text, field=field))
        except ValueError as exc:
            reply = RpcReply(ok=False, error=RpcError(code="invalid", message=str(exc)))
        if msg.reply:
            await msg.respond(reply.model_dump_json().encode())

    async def poll_once(self) -> int:
        """Read every backend once and publish; returns the number of samples."""
        samples: list[TelemetrySample] = []
        for backend in self.backends:
            try:
                samples.extend(await asyncio.to_thread(backend.read))
            except Exception:
                log.exception("%s: read failed; other backends go on", backend.name)
        if samples:
            await self.publish(samples, critical=False)
        return len(samples)

    async def run(self, stop: asyncio.Event) -> None:
        """Poll and publish until ``stop`` is set; then stop the event threads and backends."""
        loop = asyncio.get_running_loop()
        threads = [
            threading.Thread(
                target=self._event_thread, args=(b, loop), name=f"events-{b.name}", daemon=True
            )
            for b in self.backends
        ]
        for t in threads:
            t.start()
        if self.simulator is not None:
            await self.bus.subscribe_core(Subjects.chaos(self.cluster, self.node), self._on_chaos)
        log.info(
            "agent for %s/%s: backends %s, every %gs",
            self.cluster,
            self.node,
            ",".join(b.name for b in self.backends),
            self.interval_s,
        )
        self.ready.set()
        try:
            while not stop.is_set():
                await self.poll_once()
                self._poll_now.clear()
                waiters = [
                    asyncio.ensure_future(stop.wait()),
                    asyncio.ensure_future(self._poll_now.wait()),
                ]
                _, pending = await asyncio.wait(
                    waiters, timeout=self.interval_s, return_when=asyncio.FIRST_COMPLETED
                )
                for w in waiters:
                    w.cancel()
                for w in waiters:
                    with contextlib.suppress(asyncio.CancelledError):
                        await w
                del pending
        finally:
            self._halt.set()
            for b in self.backends:
                with contextlib.suppress(Exception):
                    b.close()
            for t in threads:
                await asyncio.to_thread(t.join, 2.0)


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``python -m services.detector agent``."""
    p = argparse.ArgumentParser(
        prog="python -m services.detector agent", description="GPU telemetry agent of one node"
    )
    p.add_argument("--node", required=True, help="this node's name")
    p.add_argument("--cluster", default=None, help="cluster name (default TORCHRELAY_CLUSTER)")
    p.add_argument(
        "--backend",
        default="auto",
        help=f"auto (nvml and amdsmi), or a comma list of {', '.join(BACKENDS)}",
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    p.add_argument("--scenario", default=None, help="simulator scenario file (YAML or JSON)")
    p.add_argument("--gpus", type=int, default=8, help="simulated GPUs without a scenario")
    return p


async def _amain(args: argparse.Namespace, settings: CommonSettings) -> int:
    cluster = args.cluster or settings.cluster
    backends, failed = load_backends(
        args.backend, cluster, args.node, scenario=args.scenario, gpus=args.gpus
    )
    for exc in failed:
        log.warning("%s", exc)
    if not backends:
        reasons = "; ".join(str(e) for e in failed)
        log.error("no telemetry backend could load on %s: %s", args.node, reasons)
        return EXIT_NO_BACKEND
    creds = str(settings.nats_credentials) if settings.nats_credentials else None
    bus = await Bus.connect(
        settings.nats_url,
        f"detector-agent-{args.node}",
        credentials=creds,
        timeout=settings.connect_timeout_s,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await NodeAgent(bus, cluster, args.node, backends, args.interval).run(stop)
    finally:
        await bus.close()
    return 0


def main(argv: Sequence[str]) -> int:
    """Entry point of ``python -m services.detector agent ...``; returns the exit code."""
    args = build_parser().parse_args(list(argv))
    try:
        settings = load_settings(CommonSettings)
    except SettingsError as exc:
        print(f"detector agent: {exc}", flush=True)
        return 2
    configure_logging("detector-agent", settings.log_level, settings.log_json)
    if args.interval <= 0:
        print("detector agent: --interval must be > 0", flush=True)
        return 2
    try:
        return asyncio.run(_amain(args, settings))
    except BusError as exc:
        print(f"detector agent: {exc}", flush=True)
        return 3


__all__ = ["NodeAgent", "build_parser", "main"]
