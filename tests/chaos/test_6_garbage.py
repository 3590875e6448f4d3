"""Scenario 6: malformed, oversized and wrongly-typed messages on every subject family.

Events (JetStream, every durable consumer), telemetry, critical telemetry and heartbeats
(core NATS, the detector) are dead-lettered on ``tr.dlq.<service>``; every RPC verb answers
an error reply instead of crashing; every service stays ready.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import defaultdict
from typing import Any

import nats
import pytest

from tests.chaos import chaoslib
from tests.harness import Stack
from torchrelay.contract import CONSUMERS, RPC_VERBS, Subjects

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300)]

# Over the services' expectations, under the server's max_payload (8 MB in runtime.py).
OVERSIZED_BYTES = 2 * 1024 * 1024


def garbage(token: str) -> dict[str, bytes]:
    """The three kinds of bad payload, each carrying ``token`` so its dead letter is found."""
    return {
        "malformed": f'{{"chaos": "{token}", '.encode() + b"\xff\xfe not json",
        "oversized": json.dumps({"chaos": token, "pad": "x" * OVERSIZED_BYTES}).encode(),
        "wrong_types": json.dumps(
            {
                "chaos": token,
                "event_id": 12345,
                "schema_version": "one",
                "occurred_at": [1, 2],
                "job_id": {"not": "a token"},
                "member_id": None,
                "rank": "zero",
                "step": -1.5,
                "incident": "x",
            }
        ).encode(),
    }


async def test_bad_messages_are_dead_lettered_and_services_stay_ready(
    chaos_stack: Stack, rec: chaoslib.Recorder
) -> None:
    nc = await nats.connect(chaos_stack.nats_url, max_reconnect_attempts=5)
    letters: dict[str, list[dict[str, Any]]] = defaultdict(list)

    async def on_letter(msg: Any) -> None:
        letters[msg.subject].append(json.loads(msg.data))

    sub = await nc.subscribe(Subjects.DLQ_ALL, cb=on_letter)
    try:
        js = nc.jetstream()
        # Event subjects: for every durable consumer one subject it reads (a wildcard-only
        # consumer, such as the executor's reports, gets its wildcard filled in).
        event_targets: list[tuple[str, str]] = []
        for spec in CONSUMERS.values():
            concrete = [s for s in spec.filter_subjects if "*" not in s and ">" not in s]
            subject = concrete[0] if concrete else spec.filter_subjects[0]
            subject = subject.replace("*", "chaos-job").replace(">", "chaos-job")
            event_targets.append((spec.service, subject))
        sent: list[tuple[str, str, str]] = []  # (service expected to refuse, kind, token)
        for service, subject in event_targets:
            for kind, data in garbage(token := uuid.uuid4().hex).items():
                await js.publish(subject, data, headers={"Nats-Msg-Id": token + kind})
                sent.append((service, kind, token))
        for subject in (
            Subjects.telemetry("local", "chaos-node"),
            Subjects.telemetry_critical("local", "chaos-node"),
            Subjects.heartbeat("chaos-job"),
        ):
            for kind, data in garbage(token := uuid.uuid4().hex).items():
                await nc.publish(subject, data)
                sent.append(("detector", f"{subject}:{kind}", token))
        await nc.flush()

        def missing() -> list[tuple[str, str]]:
            out = []
            for service, kind, token in sent:
                box = letters.get(Subjects.dlq(service), [])
                if not any(token in letter.get("payload", "") for letter in box):
                    out.append((service, kind))
            return out

        deadline = time.monotonic() + 90
        while missing() and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert not missing(), f"bad messages not dead-lettered: {missing()}"
        rec.ok(f"{len(sent)} bad event/telemetry/heartbeat messages dead-lettered")

        # RPC: every verb of every service answers an error reply (never a crash or silence).
        bad_replies: list[str] = []
        for service, verbs in RPC_VERBS.items():
            for verb in verbs:
                for kind, data in garbage(uuid.uuid4().hex).items():
                    subject = Subjects.rpc(service, verb)
                    try:
                        reply = await nc.request(subject, data, timeout=15)
                    except Exception as exc:
                        bad_replies.append(f"{subject} {kind}: no reply ({exc!r})")
                        continue
                    body = json.loads(reply.data)
                    error = body.get("error") or {}
                    if kind == "malformed" and body.get("ok"):
                        bad_replies.append(f"{subject} {kind}: accepted")
                    if not body.get("ok") and error.get("code") == "internal":
                        bad_replies.append(f"{subject} {kind}: internal error {error}")
        assert not bad_replies, "\n".join(bad_replies)
        rec.ok("every RPC verb answers bad requests with an error reply")
    finally:
        await sub.unsubscribe()
        await nc.close()
    ready = chaoslib.all_ready(chaos_stack)
    assert all(ready.values()), f"services not ready after bad messages: {ready}"
    rec.ok("every service ready")
