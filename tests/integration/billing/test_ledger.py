"""The ledger against a real Redis: exactly-once entries, conflicts, terms, credits, tamper."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
import redis.asyncio as aioredis

from services.billing.ledger import (
    ContractConflict,
    CorrectionRefused,
    Ledger,
    TermNotOver,
    uncovered_chain,
)
from services.billing.rules import ContractRequest, Tally
from torchrelay.contract import FaultKind, Resolution
from torchrelay.runtime import ServerProcess

from .conftest import Q1_END, Q1_START, Q2_END, make_contract, make_incident

US = timedelta(microseconds=1)


async def test_one_incident_delivered_five_times_is_one_entry(ledger: Ledger) -> None:
    contract = await make_contract(ledger)
    inc = make_incident("inc-1")
    outcomes = [(await ledger.record(inc)).outcome for _ in range(5)]
    assert outcomes == ["ok", "exists", "exists", "exists", "exists"]
    assert len(await ledger.entries(contract.contract_id)) == 1
    assert await ledger.tally(contract.contract_id) == Tally(resolved=1)
    g = await ledger.guarantee(contract.contract_id)
    assert (g.eligible_failures, g.resolved_by_migration, g.final) == (1, 1, False)


async def test_same_id_other_content_is_a_recorded_conflict(
    ledger: Ledger, redis: aioredis.Redis
) -> None:
    contract = await make_contract(ledger)
    original = make_incident("inc-1", resolution=Resolution.MIGRATED_LIVE)
    forged = make_incident("inc-1", resolution=Resolution.LOST)
    assert (await ledger.record(original)).outcome == "ok"
    before = await redis.lrange(ledger.key("chain", contract.contract_id), 0, -1)
    for _ in range(3):
        result = await ledger.record(forged)
        assert (result.outcome, result.seq) == ("conflict", 1)
    after = await redis.lrange(ledger.key("chain", contract.contract_id), 0, -1)
    assert after == before
    entry = json.loads(after[0])
    assert entry["incident"]["resolution"] == "migrated_live"
    conflicts = await redis.hgetall(ledger.key("conflict", "inc-1"))
    assert len(conflicts) == 1
    assert json.loads(next(iter(conflicts.values())))["resolution"] == "lost"
    assert await redis.zrange(ledger.key("conflicts"), 0, -1) == [b"inc-1"]
    assert await ledger.tally(contract.contract_id) == Tally(resolved=1)
    assert (await ledger.verify())["ok"]


async def test_incidents_on_term_boundaries_count_once_in_the_right_term(ledger: Ledger) -> None:
    q1 = await make_contract(ledger, start=Q1_START, end=Q1_END)
    q2 = await make_contract(ledger, start=Q1_END, end=Q2_END)
    cases = {
        "at-q1-start": (Q1_START, q1.contract_id),
        "just-before-q1-end": (Q1_END - US, q1.contract_id),
        "at-q1-end": (Q1_END, q2.contract_id),  # the end instant opens the next term
        "just-before-q2-end": (Q2_END - US, q2.contract_id),
        "at-q2-end": (Q2_END, uncovered_chain("acme")),
        "before-q1": (Q1_START - US, uncovered_chain("acme")),
        # 2025-03-31T19:00-05:00 is 2025-04-01T00:00Z: the same instant, so Q2.
        "other-zone": (datetime.fromisoformat("2025-03-31T19:00:00-05:00"), q2.contract_id),
    }
    for incident_id, (when, chain) in cases.items():
        result = await ledger.record(make_incident(incident_id, detected_at=when))
        assert (result.outcome, result.chain) == ("ok", chain), incident_id
    assert await ledger.tally(q1.contract_id) == Tally(resolved=2)
    assert await ledger.tally(q2.contract_id) == Tally(resolved=3)
    other = await ledger.record(make_incident("other-tenant", tenant="globex"))
    assert other.chain == uncovered_chain("globex")


async def test_overlapping_terms_are_refused_and_identical_creates_are_idempotent(
    ledger: Ledger,
) -> None:
    c = await make_contract(ledger)
    again, created = await ledger.create_contract(
        ContractRequest.model_validate(
            {
                "tenant": "acme",
                "term_start": Q1_START,
                "term_end": Q1_END,
                "renewal_fee_minor": 1_000_000,
                "currency": "USD",
            }
        )
    )
    assert (again, created) == (c, False)
    with pytest.raises(ContractConflict) as info:
        await make_contract(ledger, start=Q1_END - timedelta(days=1), end=Q2_END)
    assert info.value.field == "term_start"
    await make_contract(ledger, tenant="globex")  # another tenant may share the dates
    items, cursor = await ledger.list_contracts("acme")
    assert [x.contract_id for x in items] == [c.contract_id]
    assert cursor is None


async def close(ledger: Ledger, contract_id: str) -> tuple[bool, int, int]:
    r = await ledger.close_term(contract_id)
    return r.guarantee.met, r.guarantee.credit_minor, 0 if r.credit is None else 1


async def test_edges_no_failures_exactly_ninety_just_under(ledger: Ledger) -> None:
    none = await make_contract(ledger, tenant="t-none")
    await ledger.record(
        make_incident(
            "app", tenant="t-none", kind=FaultKind.APPLICATION_ERROR, resolution=Resolution.LOST
        )
    )
    assert await close(ledger, none.contract_id) == (True, 0, 0)
    g = await ledger.guarantee(none.contract_id)
    assert (g.eligible_failures, g.ratio, g.final) == (0, 1.0, True)

    exact = await make_contract(ledger, tenant="t-exact")
    for i in range(10):
        res = Resolution.MIGRATED_LIVE if i < 9 else Resolution.CHECKPOINT_RESTART
        await ledger.record(make_incident(f"x{i}", tenant="t-exact", resolution=res))
    assert await close(ledger, exact.contract_id) == (True, 0, 0)

    under = await make_contract(ledger, tenant="t-under", fee=999_999)
    for i in range(100):
        res = Resolution.MIGRATED_LIVE if i < 89 else Resolution.LOST
        await ledger.record(make_incident(f"u{i}", tenant="t-under", resolution=res))
    # Application errors never count, whatever their resolution.
    for i in range(20):
        await ledger.record(
            make_incident(
                f"a{i}",
                tenant="t-under",
                kind=FaultKind.APPLICATION_ERROR,
                resolution=Resolution.MIGRATED_LIVE,
            )
        )
    # 0.25 x 999_999 = 249_999.75 -> 250_000 (half-up)
    assert await close(ledger, under.contract_id) == (False, 250_000, 1)
    g = await ledger.guarantee(under.contract_id)
    assert (g.eligible_failures, g.resolved_by_migration, g.final) == (100, 89, True)
    credits = await ledger.credits(contract_id=under.contract_id)
    assert len(credits) == 1
    assert credits[0]["credit"]["amount_minor"] == 250_000


async def test_proactive_migrations_with_and_without_count_proactive(ledger: Ledger) -> None:
    for tenant, count in (("t-no", False), ("t-yes", True)):
        c = await make_contract(ledger, tenant=tenant, count_proactive=count)
        for i in range(8):
            await ledger.record(make_incident(f"{tenant}-live{i}", tenant=tenant))
        for i in range(2):
            await ledger.record(
                make_incident(f"{tenant}-lost{i}", tenant=tenant, resolution=Resolution.LOST)
            )
        for i in range(10):
            await ledger.record(
                make_incident(
                    f"{tenant}-pro{i}",
                    tenant=tenant,
                    kind=FaultKind.THERMAL_SLOWDOWN,
                    resolution=Resolution.MIGRATED_PROACTIVE,
                )
            )
        g = await ledger.guarantee(c.contract_id)
        assert g.prevented_failures == 10
        if count:
            assert (g.eligible_failures, g.resolved_by_migration, g.met) == (20, 18, True)
        else:
            assert (g.eligible_failures, g.resolved_by_migration, g.met) == (10, 8, False)


async def test_close_term_before_the_end_is_refused_and_closing_twice_credits_once(
    ledger: Ledger,
) -> None:
    future = await make_contract(
        ledger,
        tenant="t-future",
        start=datetime(2025, 1, 1, tzinfo=UTC),
        end=datetime(2099, 1, 1, tzinfo=UTC),
    )
    with pytest.raises(TermNotOver):
        await ledger.close_term(future.contract_id)
    c = await make_contract(ledger)
    await ledger.record(make_incident("lost", resolution=Resolution.LOST))
    first = await ledger.close_term(c.contract_id)
    second = await ledger.close_term(c.contract_id)
    assert first.newly_closed
    assert not second.newly_closed
    assert first.credit == second.credit
    assert first.credit is not None
    assert len(await ledger.credits()) == 1
    # A failure reported after the close is recorded, but the final evaluation stands.
    await ledger.record(make_incident("late", resolution=Resolution.MIGRATED_LIVE))
    assert (await ledger.guarantee(c.contract_id)) == first.guarantee
    kinds = [e["kind"] for e in await ledger.entries(c.contract_id)]
    assert kinds == ["incident", "term_closed", "incident"]
    assert (await ledger.verify(c.contract_id))["ok"]


async def test_a_correction_is_a_new_entry_pointing_at_the_old(ledger: Ledger) -> None:
    c = await make_contract(ledger)
    await ledger.record(make_incident("i1", resolution=Resolution.LOST))
    fixed = make_incident("i1", resolution=Resolution.MIGRATED_LIVE)
    result = await ledger.correct(fixed, "the migration completed after the report")
    assert (result.outcome, result.seq) == ("ok", 2)
    entries = await ledger.entries(c.contract_id)
    assert entries[1]["kind"] == "correction"
    assert entries[1]["corrects_seq"] == 1
    assert entries[0]["incident"]["resolution"] == "lost"  # the original stays
    assert await ledger.tally(c.contract_id) == Tally(resolved=1)
    # Redelivering the original or the correction changes nothing.
    assert (
        await ledger.record(make_incident("i1", resolution=Resolution.LOST))
    ).outcome == "exists"
    assert (await ledger.correct(fixed, "again")).outcome == "exists"
    with pytest.raises(CorrectionRefused):
        await ledger.correct(make_incident("nope"), "unknown")
    with pytest.raises(CorrectionRefused):
        await ledger.correct(make_incident("i1", detected_at=Q2_END), "moves terms")
    assert (await ledger.verify())["ok"]


async def test_verify_names_an_altered_entry(ledger: Ledger, redis: aioredis.Redis) -> None:
    c = await make_contract(ledger)
    for i in range(5):
        await ledger.record(make_incident(f"i{i}", resolution=Resolution.LOST))
    untouched = await ledger.verify(c.contract_id)
    assert untouched == {"ok": True, "checked": 5, "chains": 1}
    key = ledger.key("chain", c.contract_id)
    entry = json.loads(await redis.lindex(key, 2))
    entry["incident"]["resolution"] = "migrated_live"  # someone turns a loss into a save
    await redis.lset(key, 2, json.dumps(entry))
    report = await ledger.verify()
    assert not report["ok"]
    assert report["first_bad"]["contract_id"] == c.contract_id
    assert report["first_bad"]["incident_id"] == "i2"
    assert report["first_bad"]["seq"] == 3
    assert "hash" in report["first_bad"]["reason"]


async def test_verify_names_an_altered_aggregate(ledger: Ledger, redis: aioredis.Redis) -> None:
    c = await make_contract(ledger)
    await ledger.record(make_incident("i1", resolution=Resolution.LOST))
    await redis.hset(ledger.key("agg", c.contract_id), "unresolved", 0)
    report = await ledger.verify(c.contract_id)
    assert not report["ok"]
    assert "aggregate" in report["first_bad"]["reason"]


async def test_kill_9_of_redis_loses_no_acknowledged_entry(fresh_redis: ServerProcess) -> None:
    client = aioredis.from_url(fresh_redis.url)
    ledger = Ledger(client)
    c = await make_contract(ledger)
    acked = []
    for i in range(50):
        res = Resolution.MIGRATED_LIVE if i % 5 else Resolution.LOST
        result = await ledger.record(make_incident(f"k{i}", resolution=res))
        assert result.outcome == "ok"
        acked.append(f"k{i}")
    fresh_redis.kill()
    await client.aclose()
    fresh_redis.start()
    client = aioredis.from_url(fresh_redis.url)
    try:
        ledger = Ledger(client)
        entries = await ledger.entries(c.contract_id)
        assert [e["incident_id"] for e in entries] == acked
        assert await ledger.tally(c.contract_id) == Tally(resolved=40, unresolved=10)
        assert (await ledger.verify())["ok"]
        # The script cache is gone after the restart; appends still work (reloaded).
        assert (await ledger.record(make_incident("after"))).outcome == "ok"
        assert (
            await ledger.record(make_incident("k0", resolution=Resolution.LOST))
        ).outcome == "exists"
    finally:
        await client.aclose()


async def test_contract_list_pages_with_a_cursor(ledger: Ledger) -> None:
    made = []
    for q in range(5):
        start = Q1_START + timedelta(days=30 * q)
        made.append(await make_contract(ledger, start=start, end=start + timedelta(days=30)))
    seen, cursor = [], None
    while True:
        items, cursor = await ledger.list_contracts("acme", limit=2, cursor=cursor)
        seen += [c.contract_id for c in items]
        if cursor is None:
            break
    assert seen == [c.contract_id for c in made]  # by term start


async def test_a_ledger_in_another_process_sees_a_moved_head(
    ledger: Ledger, redis: aioredis.Redis
) -> None:
    # Two service replicas: each caches the chain head; a stale guess is refused by the
    # script and retried on the real head, never appended on the wrong one.
    c = await make_contract(ledger)
    other = Ledger(redis, ledger.prefix)
    await ledger.record(make_incident("a"))
    await other.record(make_incident("b"))
    await ledger.record(make_incident("c"))  # its cached head is stale here
    entries = await ledger.entries(c.contract_id)
    assert [e["incident_id"] for e in entries] == ["a", "b", "c"]
    assert (await ledger.verify())["ok"]


async def test_an_append_on_a_known_head_is_one_round_trip_fewer(
    ledger: Ledger, redis: aioredis.Redis
) -> None:
    # The head this ledger appended last is not read back before the next append.
    c = await make_contract(ledger)
    await ledger.record(make_incident("a"))
    await redis.config_resetstat()
    assert (await ledger.record(make_incident("b"))).seq == 2
    stats = await redis.info("commandstats")  # counts the script's own commands too
    assert stats["cmdstat_hmget"]["calls"] == 1  # only the script's check of the head
    # ... and a head moved meanwhile by another writer costs one refused try, not an entry.
    await Ledger(redis, ledger.prefix).record(make_incident("c"))
    assert (await ledger.record(make_incident("d"))).seq == 4
    assert [e["seq"] for e in await ledger.entries(c.contract_id)] == [1, 2, 3, 4]
    assert (await ledger.verify(c.contract_id))["ok"]
