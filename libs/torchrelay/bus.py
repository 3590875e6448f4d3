"""The bus: JetStream events, core-NATS streams and request/reply.

Every service talks to every other through this module. It owns the reliability rules of
docs/design.md §2: deterministic ``Nats-Msg-Id`` on publish, explicit durable consumers, ack only
after the handler's effects, nak with delay on transient errors, dead letters with a reason
for poison messages, dedupe by ``event_id``, deadlines on requests, compare-and-set on KV.

Its neighbours: the errors in :mod:`torchrelay.errors`, the dedupers in
:mod:`torchrelay.dedupe`, TLS in :mod:`torchrelay.tls`, provisioning in
:mod:`torchrelay.provisioning`, the generations bucket's reads and writes in
:mod:`torchrelay.generation_kv` (the errors and dedupers re-exported here under their old names).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    PubAck,
)
from nats.js.kv import KeyValue
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from pydantic import BaseModel, ValidationError

from torchrelay.auth import REVOKER, ROLES, role_inbox
from torchrelay.contract import (
    CONSUMERS,
    ConsumerSpec,
    DeadLetter,
    Event,
    Message,
    RpcError,
    RpcReply,
    Subjects,
    model_for_subject,
)
from torchrelay.dedupe import Deduper, MemoryDeduper, RedisDeduper
from torchrelay.errors import (
    BusError,
    Conflict,
    LeaseLost,
    NoResponder,
    NotFound,
    PermanentError,
    PermissionRefused,
    RequestInvalid,
    RpcFailed,
    StaleRevision,
    TransientError,
    validation_message,
)
from torchrelay.generation_kv import GenerationStore
from torchrelay.observability import ServiceMetrics, context_from_headers, inject_headers, tracer
from torchrelay.tls import TlsFiles

log = logging.getLogger("torchrelay.bus")

MAX_DLQ_PAYLOAD = 64 * 1024


async def cancel_until_done(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait for it, cancelling again while it lives.

    nats-py's connect loop retries forever and catches ``Exception`` around each attempt; on
    Python 3.11 ``asyncio.wait_for`` can turn a cancellation that lands as a refused connect
    completes into the connect's own ``OSError``, which that loop swallows, so one cancel()
    could leave it retrying for ever (a service with an unreachable NATS_URL hung instead of
    exiting).
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()


@dataclass(frozen=True)
class Delivery:
    """Metadata of one delivery of a stream message to a handler."""

    subject: str
    num_delivered: int
    stream_seq: int
    headers: dict[str, str]


JOB_USER_PREFIX = "job."
JOB_INBOX_PREFIX = "_INBOX_"
NO_RESPONDER_GRACE_S = 1.0  # how long a request retries while nobody serves its subject
AUTH_GRACE_S = 3.0  # how long a connect goes on while the server refuses the credential


EventHandler = Callable[[Event, Delivery], Awaitable[None]]
RpcHandler = Callable[[dict[str, Any]], Awaitable[Any]]


def _headers(msg: Msg) -> dict[str, str]:
    return dict(msg.headers or {})


class Bus(GenerationStore):
    """A connection to NATS for one process (``service`` names it in logs and dead letters)."""

    def __init__(self, nc: NatsClient, service: str, metrics: ServiceMetrics | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.service = service
        self.metrics = metrics
        self._kv: KeyValue | None = None
        self._replicas = 1
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Any] = []
        self._stopping = asyncio.Event()
        self.user = "(anonymous)"
        # Set when connected with a job-scoped credential: the generation is read through
        # the job's own direct-get and KV subject (no consumers, no other keys).
        self.job_id: str | None = None
        # Permission violations the server reported on this connection (newest last).
        self.refusals: list[str] = []
        # An elected service's leader lease check (torchrelay.leadership): called before
        # every publish, handler, ack and RPC answer, so a replica that lost it does nothing.
        self.fence: Callable[[], None] | None = None

    def _fenced(self) -> None:
        if self.fence is not None:
            self.fence()

    # ----------------------------------------------------------------- connection

    @classmethod
    async def connect(
        cls,
        url: str,
        service: str,
        *,
        credentials: str | None = None,
        timeout: float = 10.0,
        metrics: ServiceMetrics | None = None,
        user: str | None = None,
        password: str | None = None,
        tls: TlsFiles | None = None,
    ) -> Bus:
        """Connect with retry until ``timeout``; fail with a message naming ``NATS_URL``.

        Args:
            url: one or more ``nats://`` (or ``tls://``) URLs, comma-separated.
            service: the process's name (logs, dead letters, connection name).
            credentials: a ``.creds`` file, or a file holding ``user:password``.
            timeout: how long to keep retrying the first connection.
            metrics: the service's metrics, to count dead letters.
            user: user name (instead of a credentials file).
            password: password for ``user``.
            tls: CA / client certificate / key files (default: ``TORCHRELAY_NATS_TLS_*``).
        """
        opts: dict[str, Any] = {
            "name": service,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.2,
            "allow_reconnect": True,
        }
        if credentials:
            try:
                text = open(credentials).read().strip()  # noqa: ASYNC230, SIM115
            except OSError as exc:
                raise BusError(
                    f"TORCHRELAY_NATS_CREDENTIALS {credentials} cannot be read: {exc}"
                ) from exc
            if "BEGIN NATS USER JWT" in text:
                opts["user_credentials"] = credentials
            else:
                user, _, password = text.partition(":")
        if user:
            opts["user"] = user
            opts["password"] = password or ""
        job_id = user[len(JOB_USER_PREFIX) :] if user and user.startswith(JOB_USER_PREFIX) else None
        if job_id:
            # A job's credential may subscribe to replies under its own inbox prefix only.
            opts["inbox_prefix"] = f"{JOB_INBOX_PREFIX}{job_id}"
        elif user in ROLES or user == REVOKER:
            # So may each role: one role's replies are not readable by another.
            opts["inbox_prefix"] = role_inbox(user)
        tls = tls if tls is not None else TlsFiles.from_env()
        if tls.enabled:
            opts["tls"] = tls.context()
        who = user or ("(.creds)" if "user_credentials" in opts else "(anonymous)")
        holder: list[Bus] = []

        refused_at: list[float] = []  # authorization violations while connecting
        # A static user's refusal is final; a job credential is checked by the scheduler's
        # callout, which may be restarting: keep trying for the whole timeout.
        grace = timeout if job_id else AUTH_GRACE_S

        async def _on_error(exc: Exception) -> None:
            text = str(exc)
            if "permissions violation" in text.lower() or "authorization" in text.lower():
                if not holder:
                    refused_at.append(time.monotonic())
                    return
                log.error(
                    "NATS refused an operation of %s (user %s): %s",
                    service,
                    who,
                    text,
                    extra={"nats_user": who, "refusal": text},
                )
                holder[0].refusals.append(text)
                del holder[0].refusals[:-100]

        opts["error_cb"] = _on_error
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        servers = [u.strip() for u in url.split(",")]
        while time.monotonic() < deadline:
            # With max_reconnect_attempts=-1 nats-py retries an unreachable (or refusing)
            # server forever inside connect(); bound it by our own deadline, and give up
            # early when the server keeps refusing the credential (a job credential is
            # checked by the scheduler's callout, which may be restarting: a short grace).
            task = asyncio.ensure_future(
                nats.connect(servers=servers, connect_timeout=min(2.0, timeout), **opts)
            )
            try:
                while not task.done():
                    await asyncio.wait({task}, timeout=0.1)
                    now = time.monotonic()
                    if task.done():
                        break
                    if now > deadline or (refused_at and now - refused_at[0] > grace):
                        await cancel_until_done(task)
                        break
                if task.cancelled() or not task.done():
                    if refused_at:
                        log.error("NATS refused user %s of %s at connect", who, service)
                        raise BusError(
                            f"NATS_URL {url} refused user {who} of {service}: "
                            "Authorization Violation; check TORCHRELAY_NATS_CREDENTIALS (a job "
                            "credential ends with its job)"
                        )
                    last = TimeoutError(f"no connection within {timeout:g}s")
                    break
                nc = task.result()
                bus = cls(nc, service, metrics)
                bus.user = who
                bus.job_id = job_id
                holder.append(bus)
                return bus
            except (nats.errors.NoServersError, OSError, TimeoutError, nats.errors.Error) as exc:
                last = exc
                if "authorization" in str(exc).lower():
                    raise BusError(
                        f"NATS_URL {url} refused user {who} of {service}: {exc}; check "
                        "TORCHRELAY_NATS_CREDENTIALS (a job credential ends with its job)"
                    ) from exc
                await asyncio.sleep(0.2)
        raise BusError(
            f"NATS_URL {url} refused the connection ({type(last).__name__}: {last}); start it "
            "with 'torchrelay up' or unset NATS_URL to use the embedded server"
        )

    async def confirm(self, timeout: float = 5.0) -> None:
        """Return once the server has processed everything sent on this connection so far
        (a subscription just made included).

        nats-py's ``flush()`` writes its PING straight to the socket, ahead of commands still
        in the client's write buffer (a SUB just made sits there until the background
        flusher runs), so its PONG alone does not prove them processed. The buffer is
        written out first, then the PING/PONG round trip.

        Raises:
            BusError: no confirmation within ``timeout`` (the server is gone or overloaded).
        """
        try:
            async with asyncio.timeout(timeout):
                write_out = getattr(self.nc, "_flush_pending", None)
                if write_out is not None:
                    await write_out(force_flush=True)
                else:  # another nats-py: wait until its write buffer is empty
                    while self.nc.pending_data_size > 0:  # noqa: ASYNC110 (no event to await)
                        await asyncio.sleep(0.001)
                await self.nc.flush(timeout=max(1, math.ceil(timeout)))
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusError(
                f"NATS did not confirm what {self.service} sent within {timeout:g}s "
                f"({type(exc).__name__}: {exc}); is the server at NATS_URL overloaded or gone?"
            ) from exc

    def refused(self, subject: str) -> str | None:
        """The server's latest permission violation naming ``subject``, if any."""
        # nats-py lower-cases the server's -ERR text.
        quoted = f'"{subject}"'.lower()
        for text in reversed(self.refusals):
            if quoted in text.lower():
                return text
        return None

    async def close(self) -> None:
        """Stop consumers, drain subscriptions and close the connection."""
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            await cancel_until_done(task)
        self._tasks.clear()
        if not self.nc.is_closed:
            for sub in self._subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            self._subs.clear()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.flush(), 2.0)
            with contextlib.suppress(Exception):
                await self.nc.close()

    # ----------------------------------------------------------------- publishing

    async def publish(
        self, event: Event, subject: str, *, timeout: float = 5.0, retry_for: float = 30.0
    ) -> PubAck:
        """Publish a durable event with ``Nats-Msg-Id`` = ``event_id`` and trace context.

        Retries until ``retry_for`` (less than the stream's duplicate window), so a retried
        publish is deduplicated by the server.
        """
        self._fenced()
        with tracer().start_as_current_span(f"publish {subject}", kind=SpanKind.PRODUCER) as sp:
            sp.set_attribute("messaging.message.id", event.event_id)
            headers = inject_headers({"Nats-Msg-Id": event.event_id})
            payload = event.model_dump_json().encode()
            deadline = time.monotonic() + retry_for
            while True:
                try:
                    return await self.js.publish(subject, payload, timeout=timeout, headers=headers)
                except (
                    nats.errors.TimeoutError,
                    nats.errors.NoRespondersError,
                    nats.errors.ConnectionReconnectingError,
                    TimeoutError,
                ) as exc:
                    refused = self.refused(subject)
                    if refused:
                        raise PermissionRefused(
                            f"NATS refused publish to {subject} for user {self.user}: {refused}"
                        ) from exc
                    if time.monotonic() > deadline:
                        raise BusError(
                            f"publish to {subject} failed for {retry_for:.0f}s: {exc!r}"
                        ) from exc
                    await asyncio.sleep(0.2)

    async def publish_core(self, subject: str, message: Message) -> None:
        """Publish a loss-tolerant message on core NATS (telemetry, heartbeats)."""
        await self.nc.publish(subject, message.model_dump_json().encode(), headers=inject_headers())

    async def dead_letter(
        self, subject: str, payload: bytes, reason: str, headers: dict[str, str] | None = None
    ) -> None:
        """Send a refused message to ``tr.dlq.<service>`` with the reason."""
        letter = DeadLetter(
            service=self.service,
            subject=subject,
            reason=reason[:2000],
            payload=payload[:MAX_DLQ_PAYLOAD].decode("utf-8", errors="replace"),
            headers={k: v for k, v in (headers or {}).items() if k != "Nats-Msg-Id"},
        )
        if self.metrics is not None:
            self.metrics.dlq_messages_total.labels(self.service, reason.split(":")[0][:60]).inc()
        log.warning("dead letter", extra={"subject": subject, "reason": reason[:500]})
        try:
            await self.js.publish(
                Subjects.dlq(self.service), letter.model_dump_json().encode(), timeout=5.0
            )
        except Exception:
            log.exception("dead-letter publish failed")

    # ----------------------------------------------------------------- consuming

    async def consume(
        self,
        spec: ConsumerSpec,
        handler: EventHandler,
        deduper: Deduper,
        *,
        batch: int = 64,
        provision: bool = True,
        wants: Callable[[Event], bool] | None = None,
    ) -> None:
        """Run ``handler`` for every event of the durable consumer ``spec`` in a task.

        The handler's message is acked only after it returns. ``TransientError`` (or any
        unexpected exception) naks with a delay; at the last allowed delivery, and for
        messages that fail to parse or validate, the message goes to the dead-letter subject
        and the consumer goes on. Event ids already processed are acked and skipped.
        ``wants``: events it returns False for are valid but of no interest to this
        consumer (the handler would do nothing): acked at once, without the dedupe store's
        two round trips.
        """
        if provision:
            await self.ensure_consumer(spec)
        psub = await self.js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)
        self._subs.append(psub)
        self._tasks.append(
            asyncio.create_task(
                self._consume_loop(spec, psub, handler, deduper, batch, wants),
                name=f"consume:{spec.durable}",
            )
        )

    async def _consume_loop(
        self,
        spec: ConsumerSpec,
        psub: Any,
        handler: EventHandler,
        deduper: Deduper,
        batch: int,
        wants: Callable[[Event], bool] | None = None,
    ) -> None:
        # One message per pull while idle: nats-py's fetch(n > 1) keeps the first message of a
        # waiting pull until n arrived or the pull expired (up to 1 s: measured p90 318 ms,
        # max 771 ms from publish to handler); a batch only while a backlog is known to wait.
        want = 1
        while not self._stopping.is_set():
            try:
                msgs = await psub.fetch(want, timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                want = 1
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("fetch from %s failed: %r", spec.durable, exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                try:
                    await self._handle(spec, msg, handler, deduper, wants)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    # Outside the handler (the dedupe store, an ack): e.g. Redis restarting.
                    # The consumer must outlive it: the message comes back later.
                    log.warning("message of %s not handled, redelivered: %r", spec.durable, exc)
                    with contextlib.suppress(Exception):
                        await msg.nak(delay=1.0)
            try:  # what the consumer still held after the last message was delivered
                pending = int(msgs[-1].metadata.num_pending) if msgs else 0
            except Exception:
                pending = 0
            want = batch if pending >= batch else 1

    async def _handle(
        self,
        spec: ConsumerSpec,
        msg: Msg,
        handler: EventHandler,
        deduper: Deduper,
        wants: Callable[[Event], bool] | None = None,
    ) -> None:
        headers = _headers(msg)
        subject = msg.subject
        outcome = "ok"
        started = time.perf_counter()
        try:
            meta = msg.metadata
            delivery = Delivery(subject, meta.num_delivered, meta.sequence.stream, headers)
        except Exception:
            delivery = Delivery(subject, 1, 0, headers)
        try:
            model = model_for_subject(subject)
            if model is None:
                outcome = "dlq"
                await self.dead_letter(subject, msg.data, f"unknown subject: {subject}", headers)
                await msg.ack()
                return
            try:
                event = model.model_validate_json(msg.data)
            except ValidationError as exc:
                outcome = "dlq"
                text, _ = validation_message(exc)
                await self.dead_letter(
                    subject, msg.data, f"invalid {model.__name__}: {text}", headers
                )
                await msg.ack()
                return
            if wants is not None and not wants(event):
                outcome = "skipped"
                await msg.ack()
                return
            self._fenced()
            if await deduper.seen(event.event_id):
                outcome = "duplicate"
                await msg.ack()
                return
            ctx = context_from_headers(headers)
            with tracer().start_as_current_span(
                f"{self.service} handle {subject}",
                context=ctx,
                kind=SpanKind.CONSUMER,
                attributes={
                    "messaging.message.id": event.event_id,
                    "torchrelay.service": self.service,
                },
            ):
                try:
                    await handler(event, delivery)
                except PermanentError as exc:
                    outcome = "dlq"
                    await self.dead_letter(subject, msg.data, f"refused: {exc}", headers)
                    await msg.ack()
                    return
                except TransientError as exc:
                    outcome = "retry"
                    await self._retry_or_dlq(spec, msg, delivery, str(exc), exc.delay_s, headers)
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    outcome = "error"
                    log.exception("handler for %s failed", subject)
                    trace.get_current_span().record_exception(exc)
                    await self._retry_or_dlq(
                        spec, msg, delivery, f"{type(exc).__name__}: {exc}", 1.0, headers
                    )
                    return
            self._fenced()
            await deduper.mark(event.event_id)
            await msg.ack()
        finally:
            if self.metrics is not None:
                family = ".".join(subject.split(".")[:4])
                self.metrics.messages_total.labels(self.service, family, outcome).inc()
                self.metrics.handler_seconds.labels(self.service, family).observe(
                    time.perf_counter() - started
                )

    async def _retry_or_dlq(
        self,
        spec: ConsumerSpec,
        msg: Msg,
        delivery: Delivery,
        reason: str,
        delay_s: float,
        headers: dict[str, str],
    ) -> None:
        if delivery.num_delivered >= spec.max_deliver:
            await self.dead_letter(
                msg.subject,
                msg.data,
                f"gave up after {delivery.num_delivered} deliveries: {reason}",
                headers,
            )
            await msg.ack()
        else:
            await msg.nak(delay=delay_s)

    async def subscribe_core(
        self, subject: str, handler: Callable[[Msg], Awaitable[None]], queue: str = ""
    ) -> Any:
        """Subscribe to a core-NATS subject (telemetry, heartbeats), in a queue group."""
        sub = await self.nc.subscribe(subject, queue=queue, cb=handler)
        self._subs.append(sub)
        return sub

    # ----------------------------------------------------------------- request/reply

    async def request(
        self,
        subject: str,
        payload: BaseModel | dict[str, Any] | None = None,
        *,
        timeout: float = 5.0,
    ) -> Any:
        """Send a request and return the reply's ``result``.

        A subject nobody serves is asked again for up to ``NO_RESPONDER_GRACE_S`` (within
        ``timeout``) before :class:`NoResponder`: a service restarting, or just started,
        answers the retry.

        Raises:
            NoResponder: nobody answered within ``timeout`` (the message names the subject).
            RpcFailed: the service answered with an error.
        """
        if isinstance(payload, BaseModel):
            data = payload.model_dump_json().encode()
        else:
            data = json.dumps(payload or {}, default=str).encode()
        loop = asyncio.get_running_loop()
        started = loop.time()
        # The server answers "no responders" at once. A service that is restarting (or
        # whose subscription the server has not matched yet) is asked again for a moment.
        grace_end = started + min(timeout, NO_RESPONDER_GRACE_S)
        pause = 0.05
        try:
            while True:
                remaining = max(0.001, timeout - (loop.time() - started))
                try:
                    msg = await self.nc.request(
                        subject, data, timeout=remaining, headers=inject_headers()
                    )
                    break
                except nats.errors.NoRespondersError as exc:
                    if loop.time() + pause > grace_end:
                        raise NoResponder(f"no service answers {subject}: is it running?") from exc
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, 0.25)
        except (nats.errors.TimeoutError, TimeoutError) as exc:
            refused = self.refused(subject)
            if refused:
                raise PermissionRefused(
                    f"NATS refused a request on {subject} for user {self.user}: {refused}"
                ) from exc
            raise NoResponder(f"no reply on {subject} within {timeout:g}s") from exc
        try:
            reply = RpcReply.model_validate_json(msg.data)
        except ValidationError as exc:
            raise BusError(f"{subject} answered with a malformed reply: {exc}") from exc
        if not reply.ok:
            raise RpcFailed(subject, reply.error or RpcError(code="internal", message="?"))
        return reply.result

    async def serve(
        self, service: str, verb: str, handler: RpcHandler, *, concurrency: int = 64
    ) -> Any:
        """Answer ``tr.rpc.<service>.<verb>`` in the service's queue group.

        The handler takes the decoded JSON object and returns a JSON-able result (pydantic
        models are dumped). Invalid requests get an ``invalid`` error naming the field; an
        unexpected exception gets ``internal``; the service keeps serving.

        Up to ``concurrency`` requests of this verb are handled at once, each in its own task
        (a slow one does not hold up the others); beyond that the subscription waits for a
        free slot, so requests queue in NATS instead of piling up as tasks.
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {concurrency}")
        subject = Subjects.rpc(service, verb)
        slots = asyncio.Semaphore(concurrency)
        # The event loop keeps only weak references to tasks: hold the running ones.
        running: set[asyncio.Task[None]] = set()

        async def _answer(msg: Msg) -> None:
            try:
                self._fenced()
            except LeaseLost:
                return  # a replica that lost its lease answers nothing: the caller retries
            outcome = "ok"
            started = time.perf_counter()
            ctx = context_from_headers(_headers(msg))
            with tracer().start_as_current_span(
                f"rpc {subject}", context=ctx, kind=SpanKind.SERVER
            ):
                try:
                    try:
                        body = json.loads(msg.data or b"{}")
                    except ValueError as exc:
                        raise RequestInvalid(f"request body is not JSON: {exc}") from exc
                    if not isinstance(body, dict):
                        raise RequestInvalid("request body must be a JSON object")
                    result = await handler(body)
                    reply = RpcReply(ok=True, result=_jsonable(result))
                except ValidationError as exc:
                    outcome = "invalid"
                    text, field = validation_message(exc)
                    reply = RpcReply(
                        ok=False, error=RpcError(code="invalid", message=text, field=field)
                    )
                except RequestInvalid as exc:
                    outcome = exc.code
                    reply = RpcReply(
                        ok=False, error=RpcError(code=exc.code, message=str(exc), field=exc.field)
                    )
                except Exception as exc:
                    outcome = "internal"
                    log.exception("rpc %s failed", subject)
                    reply = RpcReply(
                        ok=False,
                        error=RpcError(code="internal", message=f"{type(exc).__name__}: {exc}"),
                    )
            if self.metrics is not None:
                self.metrics.rpc_total.labels(self.service, verb, outcome).inc()
                self.metrics.rpc_seconds.labels(self.service, verb).observe(
                    time.perf_counter() - started
                )
            if msg.reply:
                with contextlib.suppress(Exception):
                    await msg.respond(reply.model_dump_json().encode())

        def _done(task: asyncio.Task[None]) -> None:
            running.discard(task)
            slots.release()

        async def _on_request(msg: Msg) -> None:
            await slots.acquire()
            task = asyncio.create_task(_answer(msg), name=f"rpc:{subject}")
            running.add(task)
            task.add_done_callback(_done)

        sub = await self.nc.subscribe(subject, queue=f"rpc-{service}", cb=_on_request)
        self._subs.append(sub)
        return sub


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


__all__ = [
    "CONSUMERS",
    "Bus",
    "BusError",
    "Conflict",
    "Deduper",
    "Delivery",
    "MemoryDeduper",
    "NoResponder",
    "NotFound",
    "PermanentError",
    "PermissionRefused",
    "RedisDeduper",
    "RequestInvalid",
    "RpcFailed",
    "StaleRevision",
    "TlsFiles",
    "TransientError",
    "cancel_until_done",
    "validation_message",
]
