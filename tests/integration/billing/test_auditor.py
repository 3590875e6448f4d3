"""A model-based auditor (after TigerBeetle's): random histories against the real ledger.

Hypothesis generates sequences of incidents (on and around term boundaries), redeliveries,
conflicting redeliveries, corrections and term closes. A plain-Python model predicts every
answer; afterwards the auditor rebuilds the expected ledger from what was injected and checks
that the aggregates equal a recomputation from the raw entries and the model, that credits
are exactly what the rule says, that no term is ever credited twice, and that the hash chain
verifies.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.billing.ledger import CorrectionRefused, Ledger, tally_of_entries, uncovered_chain
from services.billing.rules import (
    ContractRequest,
    EntryClass,
    Tally,
    classify,
    covers,
    credit_minor,
    evaluate,
)
from torchrelay.contract import Contract, FaultKind, Incident, Resolution

from .conftest import Q1_END, Q1_START, Q2_END, make_incident

US = timedelta(microseconds=1)
INSTANTS = (
    Q1_START - US,
    Q1_START,
    Q1_START + timedelta(days=30),
    Q1_END - US,
    Q1_END,
    Q1_END + timedelta(days=1),
    Q2_END - US,
    Q2_END,
)
TENANTS = ("t0", "t1")
RESOLUTIONS = tuple(r for r in Resolution if r != Resolution.OPEN)
KINDS = (FaultKind.GPU_LOST, FaultKind.THERMAL_SLOWDOWN, FaultKind.APPLICATION_ERROR)
IDS = tuple(f"i{n}" for n in range(12))
# (tenant, start, end, fee, count_proactive, threshold)
CONTRACTS = (
    ("t0", Q1_START, Q1_END, 1_000_001, False, 0.9),
    ("t0", Q1_END, Q2_END, 333, False, 0.75),
    ("t1", Q1_START, Q2_END, 10_000, True, 0.9),
)

new_incident = st.tuples(
    st.just("incident"),
    st.sampled_from(IDS),
    st.sampled_from(TENANTS),
    st.sampled_from(INSTANTS),
    st.sampled_from(RESOLUTIONS),
    st.sampled_from(KINDS),
)
redeliver = st.tuples(st.just("duplicate"), st.integers(0, 50))
conflict = st.tuples(st.just("conflict"), st.integers(0, 50), st.sampled_from(RESOLUTIONS))
correction = st.tuples(
    st.just("correct"), st.integers(0, 50), st.sampled_from(RESOLUTIONS), st.sampled_from(KINDS)
)
close = st.tuples(st.just("close"), st.integers(0, len(CONTRACTS) - 1))
operation = st.one_of(new_incident, new_incident, redeliver, conflict, correction, close)


@dataclass
class Model:
    contracts: list[Contract]
    chain_of: dict[str, str] = field(default_factory=dict)
    versions: dict[str, list[Incident]] = field(default_factory=dict)
    effective: dict[str, EntryClass] = field(default_factory=dict)
    delivered: list[Incident] = field(default_factory=list)
    credits: dict[str, int] = field(default_factory=dict)
    closed: set[str] = field(default_factory=set)

    def chain_for(self, incident: Incident) -> str:
        for c in self.contracts:
            if c.tenant == incident.tenant and covers(c, incident.detected_at):
                return c.contract_id
        return uncovered_chain(incident.tenant)

    def record(self, incident: Incident) -> str:
        self.delivered.append(incident)
        iid = incident.incident_id
        if iid not in self.versions:
            self.versions[iid] = [incident]
            self.chain_of[iid] = self.chain_for(incident)
            self.effective[iid] = classify(incident)
            return "ok"
        return "exists" if incident in self.versions[iid] else "conflict"

    def correct(self, incident: Incident) -> str:
        iid = incident.incident_id
        if incident in self.versions[iid]:
            return "exists"
        self.versions[iid].append(incident)
        self.effective[iid] = classify(incident)
        return "ok"

    def tally(self, chain: str) -> Tally:
        return Tally.of(tuple(c for i, c in self.effective.items() if self.chain_of[i] == chain))

    def close(self, contract: Contract) -> None:
        if contract.contract_id in self.closed:
            return
        self.closed.add(contract.contract_id)
        final = evaluate(contract, self.tally(contract.contract_id), final=True)
        if not final.met:
            self.credits[contract.contract_id] = credit_minor(
                contract.renewal_fee_minor, contract.credit_rate
            )


async def run_history(url: str, ops: list[tuple[Any, ...]]) -> None:
    client = aioredis.from_url(url)
    try:
        ledger = Ledger(client, f"tr:billing:audit:{uuid.uuid4().hex[:8]}")
        contracts = []
        for tenant, start, end, fee, proactive, threshold in CONTRACTS:
            c, _ = await ledger.create_contract(
                ContractRequest.model_validate(
                    {
                        "tenant": tenant,
                        "term_start": start,
                        "term_end": end,
                        "renewal_fee_minor": fee,
                        "currency": "USD",
                        "count_proactive": proactive,
                        "threshold": threshold,
                    }
                )
            )
            contracts.append(c)
        model = Model(contracts)
        for op in ops:
            await apply(ledger, model, op)
        await audit(ledger, model)
    finally:
        await client.aclose()


async def apply(ledger: Ledger, model: Model, op: tuple[Any, ...]) -> None:
    kind = op[0]
    if kind == "incident":
        _, iid, tenant, when, resolution, fault = op
        inc = make_incident(iid, tenant=tenant, detected_at=when, resolution=resolution, kind=fault)
        expected = model.record(inc)
        assert (await ledger.record(inc)).outcome == expected
    elif kind == "duplicate" and model.delivered:
        inc = model.delivered[op[1] % len(model.delivered)]
        expected = model.record(inc)
        assert (await ledger.record(inc)).outcome == expected
    elif kind == "conflict" and model.versions:
        iid = sorted(model.versions)[op[1] % len(model.versions)]
        original = model.versions[iid][0]
        inc = original.model_copy(update={"resolution": op[2], "stall_ms": 1.5})
        expected = model.record(inc)
        assert (await ledger.record(inc)).outcome == expected
    elif kind == "correct" and model.versions:
        iid = sorted(model.versions)[op[1] % len(model.versions)]
        original = model.versions[iid][0]
        inc = original.model_copy(
            update={"resolution": op[2], "fault_kind": op[3], "lost_steps": 7}
        )
        expected = model.correct(inc)
        try:
            result = await ledger.correct(inc, "auditor correction")
        except CorrectionRefused as exc:  # pragma: no cover - the model never asks for it
            raise AssertionError(f"correction refused: {exc}") from exc
        assert result.outcome == expected
        assert result.chain == model.chain_of[iid]
    elif kind == "close":
        contract = model.contracts[op[1]]
        model.close(contract)
        await ledger.close_term(contract.contract_id)


async def audit(ledger: Ledger, model: Model) -> None:
    chains = set(await ledger.chains())
    assert chains == set(model.chain_of.values()) | model.closed
    for chain in chains:
        entries = await ledger.entries(chain)
        stored = await ledger.tally(chain)
        assert stored == tally_of_entries(entries) == model.tally(chain), chain
        # one incident/correction entry per accepted version, nothing more
        versions = sum(len(v) for i, v in model.versions.items() if model.chain_of[i] == chain)
        assert sum(1 for e in entries if e["kind"] in ("incident", "correction")) == versions
        assert sum(1 for e in entries if e["kind"] == "term_closed") == (chain in model.closed)
    credits = await ledger.credits()
    per_contract = [r["credit"]["contract_id"] for r in credits]
    assert len(per_contract) == len(set(per_contract)), "a term was credited twice"
    assert {
        r["credit"]["contract_id"]: r["credit"]["amount_minor"] for r in credits
    } == model.credits
    for contract in model.contracts:
        g = await ledger.guarantee(contract.contract_id)
        assert g.final == (contract.contract_id in model.closed)
        if not g.final:
            expected = evaluate(contract, model.tally(contract.contract_id), final=False)
            assert g == expected
    report = await ledger.verify()
    assert report["ok"], report
    total = 0
    for chain in chains:
        total += len(await ledger.entries(chain))
    assert report["checked"] == total


@given(ops=st.lists(operation, min_size=1, max_size=40))
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_random_histories_match_the_model(redis_url: str, ops: list[tuple[Any, ...]]) -> None:
    asyncio.run(run_history(redis_url, ops))


def test_instants_cover_every_boundary() -> None:
    # The auditor's instants include each boundary and its neighbours on both sides.
    for boundary in (Q1_START, Q1_END, Q2_END):
        assert boundary in INSTANTS
        assert boundary - US in INSTANTS
    assert isinstance(INSTANTS[0], datetime)
