"""Amendments on the real Redis: a restart's lost steps and stall reach the ledger as new
entries of the incident's chain, which the verifier checks like every other entry."""

from __future__ import annotations

import json

import pytest
import redis.asyncio as aioredis

from services.billing.chain import canonical_json, digest, seal
from services.billing.ledger import CorrectionRefused, Ledger, NotRecordedYet
from services.billing.rules import Tally
from torchrelay.contract import Resolution

from .conftest import make_contract, make_incident

RESTART = Resolution.CHECKPOINT_RESTART


async def test_a_restarts_lost_steps_and_stall_follow_its_entry(ledger: Ledger) -> None:
    c = await make_contract(ledger)
    closed = make_incident("r1", resolution=RESTART)  # closed before the restart is known
    await ledger.record(closed)
    steps = closed.model_copy(update={"lost_steps": 37})
    first = await ledger.amend(steps, "lost steps known at JobRestarted")
    assert (first.outcome, first.chain, first.seq) == ("ok", c.contract_id, 2)
    stalled = steps.model_copy(update={"stall_ms": 105_000.0})
    assert (await ledger.amend(stalled, "first step")).seq == 3
    entries = await ledger.entries(c.contract_id)
    assert [e["kind"] for e in entries] == ["incident", "amendment", "amendment"]
    assert [(e["amends_seq"], e["fields"]) for e in entries[1:]] == [
        (1, ["lost_steps"]),
        (2, ["stall_ms"]),
    ]
    assert entries[2]["incident"]["lost_steps"] == 37
    assert entries[2]["incident"]["stall_ms"] == 105_000.0
    assert entries[0]["incident"]["lost_steps"] is None  # the original stays as it was
    # It still counts once, as a failure not resolved by migration.
    assert await ledger.tally(c.contract_id) == Tally(unresolved=1)
    # Redeliveries change nothing: the amendment again, and the close carrying the amended
    # incident (the scheduler republishes the stored one).
    assert (await ledger.amend(stalled, "again")).outcome == "exists"
    assert (await ledger.record(stalled)).outcome == "exists"
    assert (await ledger.record(closed)).outcome == "exists"
    assert await ledger.verify(c.contract_id) == {"ok": True, "checked": 3, "chains": 1}


async def test_an_amendment_before_its_entry_waits_and_one_that_changes_more_is_refused(
    ledger: Ledger,
) -> None:
    await make_contract(ledger)
    with pytest.raises(NotRecordedYet):
        await ledger.amend(make_incident("r2", resolution=RESTART, lost_steps=3), "early")
    await ledger.record(make_incident("r2", resolution=RESTART))
    with pytest.raises(CorrectionRefused, match="changes how incident r2 counts"):
        await ledger.amend(make_incident("r2", resolution=Resolution.MIGRATED_LIVE), "no")
    moved = make_incident("r2", resolution=RESTART).model_copy(update={"node": "node-9"})
    with pytest.raises(CorrectionRefused, match="changes node"):
        await ledger.amend(moved, "no")
    assert (await ledger.verify())["ok"]


async def test_verify_names_an_amendment_that_changes_more_than_a_restart_learns(
    ledger: Ledger, redis: aioredis.Redis
) -> None:
    c = await make_contract(ledger)
    await ledger.record(make_incident("r3", resolution=RESTART))
    await ledger.amend(make_incident("r3", resolution=RESTART, lost_steps=4), "restart")
    assert (await ledger.verify(c.contract_id))["ok"]
    # Someone rewrites the amendment to move the failure to another node, with every hash
    # recomputed and the head moved along: the chain links, but the amendment breaks its rule.
    key = ledger.key("chain", c.contract_id)
    entry = json.loads(await redis.lindex(key, 1))
    entry["incident"]["node"] = "node-9"
    entry["fields"] = ["lost_steps", "node"]
    entry["digest"] = digest(entry["incident"])
    forged = seal(entry)
    await redis.lset(key, 1, canonical_json(forged))
    await redis.hset(ledger.key("head", c.contract_id), "hash", forged["hash"])
    ledger._heads.clear()
    report = await ledger.verify(c.contract_id)
    assert report["ok"] is False
    assert report["checked"] == 1
    bad = report["first_bad"]
    assert (bad["incident_id"], bad["seq"]) == ("r3", 2)
    assert "may change only lost_steps, stall_ms" in bad["reason"]
