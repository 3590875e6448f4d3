"""Scenario 5: every event of ``TR_EVENTS`` published again: nothing changes.

The copies carry the payload only, under new ``Nats-Msg-Id``s, so JetStream's own dedupe
window does not catch them and every durable consumer sees each event a second time: the
consumers' own dedupe (by ``event_id``) must make the replay a no-op for incidents, the
ledger, the guarantee, the spares and the jobs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import nats
import pytest

from tests.chaos import chaoslib
from tests.harness import Stack, wait_until
from torchrelay.contract import CONSUMERS, EVENTS_STREAM

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]


def snapshot(stack: Stack, contract_id: str) -> dict[str, Any]:
    """What a user can see of the control plane's records."""

    def read() -> dict[str, Any] | None:
        got = {
            "incidents": chaoslib.api_items(stack, "/v1/incidents"),
            "jobs": chaoslib.api_items(stack, "/v1/jobs"),
            "spares": chaoslib.api_items(stack, "/v1/spares"),
            "ledger": chaoslib.api_get(stack, "/v1/ledger/verify", contract_id=contract_id),
            "guarantee": chaoslib.api_get(stack, f"/v1/contracts/{contract_id}/guarantee"),
        }
        if any(v is None for v in got.values()):
            return None
        got["incidents"] = sorted(got["incidents"], key=lambda i: i["incident_id"])
        got["jobs"] = sorted(got["jobs"], key=lambda j: j["job_id"])
        got["spares"] = sorted(got["spares"], key=lambda s: s["slot_id"])
        return got

    return dict(wait_until(read, 60, "a snapshot of the records", interval=0.5))


async def republish_all(url: str) -> int:
    """Publish every stored event again (payload only, new msg ids); how many."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(EVENTS_STREAM.name)
        first, last = info.state.first_seq, info.state.last_seq
        count = 0
        for seq in range(first, last + 1):
            try:
                msg = await js.get_msg(EVENTS_STREAM.name, seq)
            except nats.js.errors.NotFoundError:
                continue
            assert msg.subject is not None
            await js.publish(
                msg.subject, msg.data or b"", headers={"Nats-Msg-Id": f"replay-{uuid.uuid4()}"}
            )
            count += 1
        return count
    finally:
        await nc.close()


async def consumers_idle(url: str) -> bool:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for durable in CONSUMERS:
            ci = await js.consumer_info(EVENTS_STREAM.name, durable)
            if ci.num_pending or ci.num_ack_pending:
                return False
        return True
    finally:
        await nc.close()


async def test_replay_every_event_changes_nothing(
    chaos_stack: Stack, contract_id: str, rec: chaoslib.Recorder, tmp_path: Path
) -> None:
    if not chaoslib.api_items(chaos_stack, "/v1/incidents"):
        # Run alone: make some history first (a failure migrated to a spare).
        job = chaoslib.start_job(chaos_stack, tmp_path, "replay-history", spares=1)
        try:
            chaoslib.wait_mid_run(chaos_stack, job)
            chaoslib.kill_rank(chaos_stack, job.job_id, 1)
            chaoslib.wait_job_ok(job)
        finally:
            job.stop()
        chaoslib.wait_until_closed(chaos_stack, job.job_id)
    await wait_idle(chaos_stack.nats_url)
    before = snapshot(chaos_stack, contract_id)
    assert before["incidents"], "nothing to replay: no incident on this stack"

    sent = await republish_all(chaos_stack.nats_url)
    assert sent > 0
    await wait_idle(chaos_stack.nats_url)
    rec.ok(f"every consumer processed the {sent} replayed events")
    after = snapshot(chaos_stack, contract_id)

    assert after["incidents"] == before["incidents"]
    rec.ok("incidents unchanged")
    assert after["ledger"] == before["ledger"]
    assert after["ledger"]["ok"]
    rec.ok("ledger unchanged and verifies")
    assert after["guarantee"] == before["guarantee"]
    rec.ok("guarantee unchanged")
    assert after["spares"] == before["spares"]
    rec.ok("spares unchanged")
    assert after["jobs"] == before["jobs"]
    rec.ok("jobs unchanged")
    ready = chaoslib.all_ready(chaos_stack)
    assert all(ready.values()), ready
    rec.ok("every service ready")


async def wait_idle(url: str, timeout: float = 120) -> None:
    """Block until every durable consumer has nothing pending or unacknowledged."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await consumers_idle(url):
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"durable consumers still busy after {timeout:.0f}s")
