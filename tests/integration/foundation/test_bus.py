"""The bus against a real nats-server (and Redis for dedupe): docs/design.md §2's guarantees."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from torchrelay.bus import (
    Bus,
    Delivery,
    MemoryDeduper,
    NoResponder,
    RedisDeduper,
    RpcFailed,
    StaleRevision,
    TransientError,
)
from torchrelay.contract import (
    ConsumerSpec,
    DeadLetter,
    Event,
    Generation,
    JobFinished,
    RankAssignment,
    Subjects,
)
from torchrelay.observability import ServiceMetrics

SUBJECT = Subjects.JOB_FINISHED


def finished(i: int) -> JobFinished:
    return JobFinished(
        event_id=f"evt-{i}", source="test", job_id=f"job-{i}", tenant="t", outcome="succeeded"
    )


def spec(durable: str, **kw: object) -> ConsumerSpec:
    return ConsumerSpec(service="test", durable=durable, filter_subjects=[SUBJECT], **kw)  # type: ignore[arg-type]


async def wait_for(
    cond: Callable[[], Awaitable[bool]] | Callable[[], bool], timeout: float = 10.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = cond()
        if asyncio.iscoroutine(res):
            res = await res
        if res:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met before the deadline")


async def dlq_letters(bus: Bus, service: str) -> list[DeadLetter]:
    psub = await bus.js.pull_subscribe(Subjects.dlq(service), stream="TR_DLQ")
    out = []
    try:
        for msg in await psub.fetch(100, timeout=1.0):
            out.append(DeadLetter.model_validate_json(msg.data))
            await msg.ack()
    except TimeoutError:
        pass
    await psub.unsubscribe()
    return out


async def test_same_event_id_published_twice_reaches_consumer_once(bus: Bus) -> None:
    got: list[str] = []

    async def handler(event: Event, _: Delivery) -> None:
        got.append(event.event_id)

    await bus.publish(finished(1), SUBJECT)
    await bus.publish(finished(1), SUBJECT)  # a publisher retry: same Nats-Msg-Id
    await bus.publish(finished(2), SUBJECT)
    await bus.consume(spec("once"), handler, MemoryDeduper())
    await wait_for(lambda: len(got) >= 2)
    await asyncio.sleep(0.3)  # let a wrongly delivered duplicate show itself
    assert got == ["evt-1", "evt-2"]


async def test_consumer_dedupes_ids_it_already_processed(bus: Bus, redis: aioredis.Redis) -> None:
    """Two distinct stream messages with one event_id (outside the server's window) → once."""
    got: list[str] = []

    async def handler(event: Event, _: Delivery) -> None:
        got.append(event.event_id)

    ev = finished(3)
    await bus.js.publish(SUBJECT, ev.model_dump_json().encode())  # no Nats-Msg-Id
    await bus.js.publish(SUBJECT, ev.model_dump_json().encode())
    await bus.publish(finished(4), SUBJECT)
    await bus.consume(spec("dedupe"), handler, RedisDeduper(redis, "test"))
    await wait_for(lambda: "evt-4" in got)
    assert got == ["evt-3", "evt-4"]


async def test_handler_error_is_redelivered_and_then_processed(bus: Bus) -> None:
    attempts: list[int] = []
    done: list[str] = []

    async def flaky(event: Event, delivery: Delivery) -> None:
        attempts.append(delivery.num_delivered)
        if delivery.num_delivered == 1:
            raise TransientError("redis briefly away", delay_s=0.2)
        done.append(event.event_id)

    await bus.publish(finished(5), SUBJECT)
    await bus.consume(
        spec("flaky", backoff_s=[0.2, 0.5], max_deliver=4, ack_wait_s=1.0), flaky, MemoryDeduper()
    )
    await wait_for(lambda: done == ["evt-5"])
    assert attempts == [1, 2]


async def test_crash_before_ack_redelivers_and_dedupe_keeps_effect_single(
    bus: Bus, redis: aioredis.Redis, nats_url: str, redis_url: str
) -> None:
    await bus.publish(finished(6), SUBJECT)
    durable = "crashy"
    await bus.provision_consumer(spec(durable, backoff_s=[0.5, 1.0], max_deliver=5, ack_wait_s=1.0))
    script = Path(__file__).with_name("crashing_consumer.py")
    proc = subprocess.run(
        [sys.executable, str(script), nats_url, redis_url, durable, SUBJECT],
        timeout=60,
        capture_output=True,
    )
    assert proc.returncode == 17, proc.stderr.decode()[-2000:]
    assert await redis.lrange("effects", 0, -1) == [b"evt-6"]

    deliveries: list[int] = []

    async def handler(event: Event, delivery: Delivery) -> None:
        deliveries.append(delivery.num_delivered)
        await redis.rpush("effects", event.event_id)

    acked: list[bool] = []

    class Spy(RedisDeduper):
        async def seen(self, event_id: str) -> bool:
            result = await super().seen(event_id)
            acked.append(result)
            return result

    await bus.consume(
        spec(durable, backoff_s=[0.5, 1.0], max_deliver=5, ack_wait_s=1.0),
        handler,
        Spy(redis, "test"),
        provision=False,
    )
    await wait_for(lambda: acked == [True], timeout=15)  # the message came back, was dropped
    assert deliveries == []
    assert await redis.lrange("effects", 0, -1) == [b"evt-6"]


async def test_malformed_payload_goes_to_dlq_and_next_message_is_processed(bus: Bus) -> None:
    got: list[str] = []

    async def handler(event: Event, _: Delivery) -> None:
        got.append(event.event_id)

    await bus.js.publish(SUBJECT, b"{not json")
    await bus.js.publish(
        SUBJECT,
        json.dumps(
            {"event_id": "x", "source": "s", "job_id": "j", "tenant": "t", "outcome": "exploded"}
        ).encode(),
    )
    await bus.publish(finished(7), SUBJECT)
    await bus.consume(spec("poison"), handler, MemoryDeduper())
    await wait_for(lambda: got == ["evt-7"])
    letters = await dlq_letters(bus, "test")
    assert len(letters) == 2
    assert all(letter.subject == SUBJECT for letter in letters)
    assert "invalid JobFinished" in letters[0].reason
    assert "outcome" in letters[1].reason  # names the offending field
    assert letters[0].payload == "{not json"


async def test_restarted_consumer_resumes_where_it_left_off(nats_url: str, bus: Bus) -> None:
    for i in range(10, 15):
        await bus.publish(finished(i), SUBJECT)
    first: list[str] = []
    b1 = await Bus.connect(nats_url, "first")
    stop_after = asyncio.Event()

    async def h1(event: Event, _: Delivery) -> None:
        if len(first) >= 2:
            stop_after.set()
            await asyncio.sleep(3600)  # never acks: the process "dies" here
        first.append(event.event_id)

    await b1.consume(
        spec("resume", ack_wait_s=1.0, backoff_s=[1.0, 2.0]), h1, MemoryDeduper(), batch=1
    )
    await asyncio.wait_for(stop_after.wait(), 10)
    await b1.close()

    second: list[str] = []

    async def h2(event: Event, _: Delivery) -> None:
        second.append(event.event_id)

    await bus.consume(
        spec("resume", ack_wait_s=1.0, backoff_s=[1.0, 2.0]), h2, MemoryDeduper(), provision=False
    )
    await wait_for(lambda: len(second) >= 3, timeout=15)
    await asyncio.sleep(1.5)  # past ack_wait: an acked message would not come back anyway
    assert first == ["evt-10", "evt-11"]
    # The message in flight when the first consumer died (evt-12) is redelivered after
    # ack_wait, so it may come after the newer ones; nothing acked is seen again.
    assert sorted(second) == ["evt-12", "evt-13", "evt-14"]


async def test_confirm_writes_a_new_subscription_before_its_ping(nats_url: str) -> None:
    """nats-py's flush() alone writes its PING ahead of a SUB still in the write buffer, so
    its PONG does not prove the subscription reached the server; confirm() does."""
    probe = await Bus.connect(nats_url, "confirm-probe")
    written: list[bytes] = []
    transport: Any = probe.nc._transport
    write, writelines = transport.write, transport.writelines

    def record_write(data: bytes) -> None:
        written.append(bytes(data))
        write(data)

    def record_writelines(lines: list[bytes]) -> None:
        lines = list(lines)
        written.extend(bytes(line) for line in lines)
        writelines(lines)

    transport.write, transport.writelines = record_write, record_writelines
    try:
        got: list[bytes] = []

        async def on(msg: Any) -> None:
            got.append(msg.data)

        await probe.nc.subscribe("tr.test.confirm", cb=on)
        await probe.confirm()
        stream = b"".join(written)
        assert b"SUB tr.test.confirm" in stream
        assert stream.index(b"SUB tr.test.confirm") < stream.rindex(b"PING"), stream
        # What the order buys: another connection's publish after confirm() is delivered.
        other = await Bus.connect(nats_url, "confirm-other")
        try:
            await other.nc.publish("tr.test.confirm", b"hello")
            await other.confirm()
            deadline = time.monotonic() + 5
            while not got and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert got == [b"hello"]
        finally:
            await other.close()
    finally:
        transport.write, transport.writelines = write, writelines
        await probe.close()


async def test_a_request_sent_just_before_its_service_subscribes_is_answered(
    bus: Bus, nats_url: str
) -> None:
    """A service restarting (or just started) answers the retry of a "no responders"."""
    late = await Bus.connect(nats_url, "late-service")

    async def echo(body: dict[str, Any]) -> dict[str, Any]:
        return body

    async def serve_later() -> None:
        await asyncio.sleep(0.3)
        await late.serve("late", "echo", echo)

    serving = asyncio.create_task(serve_later())
    try:
        answer = await bus.request(Subjects.rpc("late", "echo"), {"n": 7}, timeout=5.0)
        assert answer == {"n": 7}
        assert serving.done()
    finally:
        await serving
        await late.close()


async def test_request_without_responder_fails_in_deadline_naming_subject(bus: Bus) -> None:
    subject = Subjects.rpc("nobody", "ping")
    started = time.monotonic()
    with pytest.raises(NoResponder, match=r"tr\.rpc\.nobody\.ping"):
        await bus.request(subject, {}, timeout=1.0)
    assert time.monotonic() - started < 1.5


async def test_rpc_invalid_request_names_field_and_service_keeps_serving(bus: Bus) -> None:
    async def double(body: dict[str, object]) -> dict[str, int]:
        return {"twice": 2 * int(JobFinished.model_validate(body).exit_code)}

    await bus.serve("calc", "double", double)
    with pytest.raises(RpcFailed) as err:
        await bus.request(Subjects.rpc("calc", "double"), {"exit_code": "x"}, timeout=2)
    assert err.value.error.code == "invalid"
    assert err.value.error.field in {"event_id", "exit_code"}
    ok = await bus.request(
        Subjects.rpc("calc", "double"), finished(1).model_copy(update={"exit_code": 4}), timeout=2
    )
    assert ok == {"twice": 8}


async def test_rpc_latency_and_outcomes_are_in_the_services_metrics(nats_url: str) -> None:
    metrics = ServiceMetrics("metered")
    served = await Bus.connect(nats_url, "metered", metrics=metrics)
    try:

        async def slow_double(body: dict[str, object]) -> dict[str, int]:
            await asyncio.sleep(0.05)  # the latency the histogram must see, not a wait
            return {"twice": 2 * int(JobFinished.model_validate(body).exit_code)}

        await served.serve("metered", "double", slow_double)
        subject = Subjects.rpc("metered", "double")
        await served.request(subject, finished(1).model_copy(update={"exit_code": 3}), timeout=2)
        with pytest.raises(RpcFailed):
            await served.request(subject, {"exit_code": "x"}, timeout=2)
    finally:
        await served.close()
    labels = {"service": "metered", "verb": "double"}
    value = metrics.registry.get_sample_value
    assert value("torchrelay_rpc_seconds_count", labels) == 2
    assert (value("torchrelay_rpc_seconds_sum", labels) or 0) >= 0.05
    assert value("torchrelay_rpc_total", {**labels, "outcome": "ok"}) == 1
    assert value("torchrelay_rpc_total", {**labels, "outcome": "invalid"}) == 1


async def test_rpc_requests_of_one_verb_are_answered_concurrently(bus: Bus) -> None:
    # Each request waits until all four are being handled: served one at a time, the first
    # would wait forever and every request would time out.
    arrived = 0
    all_in = asyncio.Event()

    async def gather(body: dict[str, object]) -> dict[str, object]:
        nonlocal arrived
        arrived += 1
        if arrived == 4:
            all_in.set()
        await asyncio.wait_for(all_in.wait(), 5)
        return {"n": body["n"]}

    await bus.serve("calc", "gather", gather)
    subject = Subjects.rpc("calc", "gather")
    answers = await asyncio.gather(*(bus.request(subject, {"n": n}, timeout=3) for n in range(4)))
    assert answers == [{"n": n} for n in range(4)]


async def test_rpc_concurrency_is_bounded_and_errors_still_answered(bus: Bus) -> None:
    running = peak = 0
    release = asyncio.Event()

    async def slow(body: dict[str, object]) -> dict[str, object]:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            await release.wait()
            if body.get("fail"):
                raise RuntimeError("boom")
            return {"n": body["n"]}
        finally:
            running -= 1

    await bus.serve("calc", "slow", slow, concurrency=2)
    subject = Subjects.rpc("calc", "slow")
    calls = [
        asyncio.ensure_future(bus.request(subject, {"n": n, "fail": n == 3}, timeout=5))
        for n in range(5)
    ]
    await wait_for(lambda: running == 2, timeout=5)
    await asyncio.sleep(0.2)  # the other three are waiting for a slot, not running
    assert running == 2
    release.set()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert peak == 2
    assert [r for n, r in enumerate(results) if n != 3] == [{"n": n} for n in (0, 1, 2, 4)]
    assert isinstance(results[3], RpcFailed)
    assert results[3].error.code == "internal"
    assert "boom" in results[3].error.message


async def test_kv_update_with_stale_revision_is_refused(bus: Bus) -> None:
    gen1 = Generation(
        job_id="kvjob",
        generation=1,
        world_size=1,
        store_member="m0",
        store_addr="127.0.0.1:1",
        ranks=[RankAssignment(rank=0, member_id="m0", node="n0", gpu=0)],
    )
    kv = await bus.generations()
    with contextlib.suppress(Exception):
        await kv.delete("kvjob")
    current = await bus.get_generation("kvjob")
    rev = await bus.put_generation(gen1, current[1] if current else None)
    gen2 = gen1.model_copy(update={"generation": 2})
    rev2 = await bus.put_generation(gen2, rev)
    with pytest.raises(StaleRevision, match="kvjob"):
        await bus.put_generation(gen1.model_copy(update={"generation": 3}), rev)
    got = await bus.get_generation("kvjob")
    assert got is not None
    assert got[0].generation == 2
    assert got[1] == rev2


async def test_trace_started_before_publish_continues_in_consumer(bus: Bus) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    seen_trace: list[int] = []

    async def handler(event: Event, _: Delivery) -> None:
        seen_trace.append(trace.get_current_span().get_span_context().trace_id)

    # The bus uses the global tracer provider; point it at ours for this test.
    from torchrelay import observability

    original = observability.tracer
    observability_tracer = provider.get_tracer("torchrelay")
    import torchrelay.bus as busmod

    busmod.tracer = lambda name="torchrelay": observability_tracer  # type: ignore[assignment]
    try:
        await bus.consume(spec("traced"), handler, MemoryDeduper())
        with tracer.start_as_current_span("telemetry sample") as root:
            trace_id = root.get_span_context().trace_id
            await bus.publish(finished(20), SUBJECT)
        await wait_for(lambda: bool(seen_trace))
    finally:
        busmod.tracer = original  # type: ignore[assignment]
    assert seen_trace == [trace_id]
    names = {s.name for s in exporter.get_finished_spans()}
    assert f"test handle {SUBJECT}" in names
