"""The ledger in Redis: contracts, the append-only hash-chained entries, aggregates, credits.

Every write to the ledger goes through one Lua script (``APPEND_LUA``), so an entry, its
index, the per-term aggregate and (at a term's close) the credit change together or not at
all. The script answers:

- ``ok``: appended;
- ``exists``: this incident id is already recorded with the same content (a redelivery);
- ``conflict``: this incident id is recorded with other content; the other content is kept
  under ``conflict:<incident>`` and counted, the original entry is never touched;
- ``stale``: the chain's head moved since the caller read it; the caller rebuilds the entry
  on the new head and tries again.
An ``amendment`` (``amendments.py``) adds what an incident learnt after its close.

Hashing (see ``chain.py``) happens in Python because Redis' Lua has no SHA-256; the script
makes the chain safe by appending only when the caller's ``prev_hash``/``seq`` are still the
head. Redis runs with AOF ``appendfsync always``, so an answered append survives kill -9.

Keys (prefix ``tr:billing``), one chain per contract, ``~tenant:<t>`` for incidents of a
tenant that no contract covers (recorded as evidence, counted nowhere):

    contract:<id>          contract JSON            contracts / tenant:<t>:starts  zsets by start
    tenant:<t>:ends        hash id -> term end (µs)
    chain:<chain>          list of entry JSON       head:<chain>   hash seq, hash
    chains                 set of chain ids
    inc:<incident>         hash chain, seq, class, d:<digest> -> seq of each known version
    agg:<chain>            hash class -> count, entries, corrections
    conflict:<incident>    hash digest -> content   conflicts      zset incident -> first seen
    closed:<contract>      JSON of the final evaluation
    credit:<id>            JSON of a credit          credits        zset id -> issued at (µs)
    credit_published       set of credit ids whose CreditIssued was acknowledged by JetStream
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from torchrelay.contract import Contract, CreditIssued, Guarantee, Incident, utcnow

from .amendments import AmendmentRefused, amended_fields, amendment_problem
from .chain import GENESIS, BadEntry, ChainVerifier, canonical_json, digest, seal
from .rules import (
    ContractRequest,
    EntryClass,
    Tally,
    classify,
    covers,
    credit_id_for,
    epoch_us,
    evaluate,
)

APPEND_LUA = (
    """
-- KEYS: 1 chain list, 2 head, 3 inc, 4 agg, 5 conflict, 6 chains set, 7 closed,
--       8 credit, 9 credits zset, 10 conflicts zset
-- ARGV: 1 mode, 2 chain id, 3 expected head seq, 4 expected head hash, 5 entry json,
--       6 entry hash, 7 content digest, 8 new class, 9 old class, 10 conflict json,
--       11 closed json, 12 credit json, 13 credit id, 14 credit score, 15 now score,
--       16 incident id, 17 (amendment) the incident's seq it follows
local mode = ARGV[1]
if mode == 'incident' then
  if redis.call('EXISTS', KEYS[3]) == 1 then
    local known = redis.call('HGET', KEYS[3], 'd:' .. ARGV[7])
    if known then return {'exists', known} end
    if redis.call('HSETNX', KEYS[5], ARGV[7], ARGV[10]) == 1 then
      redis.call('ZADD', KEYS[10], 'NX', ARGV[15], ARGV[16])
    end
    return {'conflict', redis.call('HGET', KEYS[3], 'seq')}
  end
elseif mode == 'correction' then
  if redis.call('EXISTS', KEYS[3]) == 0 then return {'missing', '0'} end
  local known = redis.call('HGET', KEYS[3], 'd:' .. ARGV[7])
  if known then return {'exists', known} end
  if redis.call('HGET', KEYS[3], 'class') ~= ARGV[9] then return {'stale', '0'} end
elseif mode == 'amendment' then
  if redis.call('EXISTS', KEYS[3]) == 0 then return {'missing', '0'} end
  local known = redis.call('HGET', KEYS[3], 'd:' .. ARGV[7])
  if known then return {'exists', known} end
  if redis.call('HGET', KEYS[3], 'seq') ~= ARGV[17] then return {'stale', '0'} end
elseif mode == 'close' then
  local closed = redis.call('GET', KEYS[7])
  if closed then return {'exists', closed} end
end
local head = redis.call('HMGET', KEYS[2], 'seq', 'hash')
local hseq = head[1] or '0'
local hhash = head[2] or '"""
    + GENESIS
    + """'
if hseq ~= ARGV[3] or hhash ~= ARGV[4] then return {'stale', hseq, hhash} end
local seq = tonumber(hseq) + 1
redis.call('RPUSH', KEYS[1], ARGV[5])
redis.call('HSET', KEYS[2], 'seq', seq, 'hash', ARGV[6])
redis.call('SADD', KEYS[6], ARGV[2])
if mode == 'incident' then
  redis.call('HSET', KEYS[3], 'chain', ARGV[2], 'seq', seq, 'class', ARGV[8],
             'd:' .. ARGV[7], seq)
  redis.call('HINCRBY', KEYS[4], 'entries', 1)
  redis.call('HINCRBY', KEYS[4], ARGV[8], 1)
elseif mode == 'correction' then
  redis.call('HSET', KEYS[3], 'seq', seq, 'class', ARGV[8], 'd:' .. ARGV[7], seq)
  redis.call('HINCRBY', KEYS[4], ARGV[9], -1)
  redis.call('HINCRBY', KEYS[4], ARGV[8], 1)
  redis.call('HINCRBY', KEYS[4], 'corrections', 1)
elseif mode == 'amendment' then
  redis.call('HSET', KEYS[3], 'seq', seq, 'd:' .. ARGV[7], seq)
elseif mode == 'close' then
  redis.call('SET', KEYS[7], ARGV[11])
  if ARGV[13] ~= '' then
    redis.call('SET', KEYS[8], ARGV[12])
    redis.call('ZADD', KEYS[9], ARGV[14], ARGV[13])
  end
end
return {'ok', tostring(seq)}
"""
)

CREATE_CONTRACT_LUA = """
-- KEYS: 1 contract, 2 contracts zset, 3 tenant starts zset, 4 tenant ends hash
-- ARGV: 1 contract id, 2 contract json, 3 start µs, 4 end µs
local existing = redis.call('GET', KEYS[1])
if existing then
  if existing == ARGV[2] then return {'exists', ARGV[1]} end
  return {'conflict', ARGV[1]}
end
local s = tonumber(ARGV[3])
local others = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[4])
for _, other in ipairs(others) do
  local other_end = tonumber(redis.call('HGET', KEYS[4], other))
  if other_end > s then return {'overlap', other} end
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[4])
return {'ok', ARGV[1]}
"""

MAX_APPEND_TRIES = 100
VERIFY_CHUNK = 2000


class LedgerError(Exception):
    """Base of the ledger's refusals; ``field`` names the request field at fault."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ContractNotFound(LedgerError):
    """No contract has this id."""


class ContractConflict(LedgerError):
    """The contract overlaps another of its tenant, or its id exists with other content."""


class TermNotOver(LedgerError):
    """``close_term`` before ``term_end``."""


class CorrectionRefused(LedgerError):
    """A correction names an unknown incident or moves it to another contract."""


class NotRecordedYet(LedgerError):
    """An amendment arrived before its incident's entry: try again later."""


@dataclass(frozen=True)
class AppendResult:
    """What the append script answered for one entry."""

    outcome: str  # ok | exists | conflict
    chain: str
    seq: int
    entry_class: EntryClass | None = None


@dataclass(frozen=True)
class CloseResult:
    """The final evaluation of a term and the credit it issued (if any)."""

    guarantee: Guarantee
    credit: CreditIssued | None
    newly_closed: bool
    published: bool
    close_seq: int
    close_hash: str


def uncovered_chain(tenant: str) -> str:
    """The chain of a tenant's incidents that no contract covers."""
    return f"~tenant:{tenant}"


def tally_of_entries(entries: list[dict[str, Any]]) -> Tally:
    """Recompute a chain's tally from its raw entries (the latest version of each incident)."""
    effective: dict[str, EntryClass] = {}
    for entry in entries:
        if entry.get("kind") in ("incident", "correction", "amendment"):
            effective[str(entry["incident_id"])] = EntryClass(entry["class"])
    return Tally.of(tuple(effective.values()))


class Ledger:
    """The billing ledger on one Redis, under ``prefix`` (``tr:billing``)."""

    def __init__(
        self, redis: Any, prefix: str = "tr:billing", clock: Callable[[], datetime] = utcnow
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.clock = clock
        self._append = redis.register_script(APPEND_LUA)
        self._create = redis.register_script(CREATE_CONTRACT_LUA)
        # Contracts are immutable once stored, so they are cached for good. Chain heads are
        # cached optimistically: the append script refuses a stale head and answers the
        # current one, so a wrong guess costs one retry, never a wrong entry.
        self._contracts: dict[str, Contract] = {}
        self._heads: dict[str, tuple[int, str]] = {}

    def key(self, *parts: str) -> str:
        """A key under this ledger's prefix."""
        return ":".join((self.prefix, *parts))

    # ------------------------------------------------------------------ contracts

    async def create_contract(self, request: ContractRequest) -> tuple[Contract, bool]:
        """Store a contract; ``(contract, created)``. A retried identical create is a no-op.

        Raises:
            ContractConflict: its term overlaps another contract of the tenant, or its id
                exists with other content.
        """
        contract = request.to_contract()
        text = canonical_json(contract.model_dump(mode="json"))
        outcome, other = await self._create(
            keys=[
                self.key("contract", contract.contract_id),
                self.key("contracts"),
                self.key("tenant", contract.tenant, "starts"),
                self.key("tenant", contract.tenant, "ends"),
            ],
            args=[
                contract.contract_id,
                text,
                epoch_us(contract.term_start),
                epoch_us(contract.term_end),
            ],
        )
        outcome, other = _text(outcome), _text(other)
        if outcome == "overlap":
            raise ContractConflict(
                f"the term overlaps contract {other} of tenant {contract.tenant}; a tenant's "
                "terms must not overlap (end the other term first)",
                "term_start",
            )
        if outcome == "conflict":
            raise ContractConflict(
                f"contract {other} exists with other terms; contracts are immutable", "contract_id"
            )
        return contract, outcome == "ok"

    async def get_contract(self, contract_id: str) -> Contract:
        """The contract ``contract_id``.

        Raises:
            ContractNotFound: no such contract.
        """
        cached = self._contracts.get(contract_id)
        if cached is not None:
            return cached
        raw = await self.redis.get(self.key("contract", contract_id))
        if raw is None:
            raise ContractNotFound(f"no contract {contract_id!r}", "contract_id")
        contract = Contract.model_validate_json(raw)
        self._contracts[contract_id] = contract
        return contract

    async def list_contracts(
        self, tenant: str | None = None, limit: int = 100, cursor: str | None = None
    ) -> tuple[list[Contract], str | None]:
        """Contracts by term start (of one tenant when given), a page at a time."""
        start = int(cursor) if cursor else 0
        index = self.key("tenant", tenant, "starts") if tenant else self.key("contracts")
        ids = [_text(i) for i in await self.redis.zrange(index, start, start + limit)]
        more = len(ids) > limit
        ids = ids[:limit]
        raws = await self.redis.mget([self.key("contract", i) for i in ids]) if ids else []
        items = [Contract.model_validate_json(r) for r in raws if r is not None]
        return items, (str(start + limit) if more else None)

    async def contract_for(self, tenant: str, instant: datetime) -> Contract | None:
        """The contract of ``tenant`` whose term ``[start, end)`` contains ``instant``."""
        ids = await self.redis.zrevrangebyscore(
            self.key("tenant", tenant, "starts"), epoch_us(instant), "-inf", start=0, num=1
        )
        if not ids:
            return None
        contract = await self.get_contract(_text(ids[0]))
        return contract if covers(contract, instant) else None

    # ------------------------------------------------------------------ appends

    def _keys(
        self, chain: str, incident_id: str = "-", contract_id: str = "-", credit_id: str = "-"
    ) -> list[str]:
        return [
            self.key("chain", chain),
            self.key("head", chain),
            self.key("inc", incident_id),
            self.key("agg", chain),
            self.key("conflict", incident_id),
            self.key("chains"),
            self.key("closed", contract_id),
            self.key("credit", credit_id),
            self.key("credits"),
            self.key("conflicts"),
        ]

    async def head(self, chain: str) -> tuple[int, str]:
        """``(seq, hash)`` of a chain's last entry (``(0, GENESIS)`` when empty)."""
        seq, hash_ = await self.redis.hmget(self.key("head", chain), "seq", "hash")
        return (int(seq), _text(hash_)) if seq is not None else (0, GENESIS)

    async def record(self, incident: Incident) -> AppendResult:
        """Append a closed incident once: ``ok``, ``exists`` or ``conflict``."""
        contract = await self.contract_for(incident.tenant, incident.detected_at)
        chain = contract.contract_id if contract else uncovered_chain(incident.tenant)
        content = incident.model_dump(mode="json")
        content_digest = digest(content)
        entry_class = classify(incident)
        # The cached head saves a round trip per append; a stale one is refused by the
        # script, which answers the real head to build on next.
        cached = self._heads.get(chain)
        seq, prev = cached if cached is not None else await self.head(chain)
        for _ in range(MAX_APPEND_TRIES):
            entry = seal(
                {
                    "seq": seq + 1,
                    "chain": chain,
                    "kind": "incident",
                    "incident_id": incident.incident_id,
                    "class": entry_class.value,
                    "incident": content,
                    "digest": content_digest,
                    "recorded_at": self.clock().isoformat(),
                    "prev_hash": prev,
                }
            )
            outcome, value, *rest = await self._run(
                self._keys(chain, incident.incident_id),
                [
                    "incident",
                    chain,
                    seq,
                    prev,
                    canonical_json(entry),
                    entry["hash"],
                    content_digest,
                    entry_class.value,
                    "",
                    canonical_json(content),
                    "",
                    "",
                    "",
                    0,
                    epoch_us(self.clock()),
                    incident.incident_id,
                ],
            )
            if outcome == "stale":
                seq, prev = int(value), rest[0]
                continue
            if outcome == "ok":
                self._heads[chain] = (int(value), str(entry["hash"]))
            return AppendResult(outcome, chain, int(value), entry_class)
        raise RuntimeError(f"chain {chain} kept moving during {MAX_APPEND_TRIES} append tries")

    async def correct(self, incident: Incident, reason: str) -> AppendResult:
        """Append a correction of a recorded incident: a new entry pointing at the old one.

        The corrected incident must stay in the same contract's term (same tenant, a
        detected_at in the same term); the aggregates move its count from the old class to
        the new one in the same script.

        Raises:
            CorrectionRefused: the incident is unknown, or the correction moves it elsewhere.
        """
        inc_key = self.key("inc", incident.incident_id)
        for _ in range(MAX_APPEND_TRIES):
            chain_raw, cur_seq, cur_class = await self.redis.hmget(inc_key, "chain", "seq", "class")
            if chain_raw is None:
                raise CorrectionRefused(
                    f"incident {incident.incident_id} is not in the ledger; record it first",
                    "incident_id",
                )
            chain = _text(chain_raw)
            contract = await self.contract_for(incident.tenant, incident.detected_at)
            target = contract.contract_id if contract else uncovered_chain(incident.tenant)
            if target != chain:
                raise CorrectionRefused(
                    f"the correction moves incident {incident.incident_id} from {chain} to "
                    f"{target}; correct tenant or detected_at only within the same term",
                    "detected_at",
                )
            content = incident.model_dump(mode="json")
            content_digest = digest(content)
            entry_class = classify(incident)
            seq, prev = await self.head(chain)
            entry = seal(
                {
                    "seq": seq + 1,
                    "chain": chain,
                    "kind": "correction",
                    "incident_id": incident.incident_id,
                    "class": entry_class.value,
                    "corrects_seq": int(cur_seq),
                    "reason": reason,
                    "incident": content,
                    "digest": content_digest,
                    "recorded_at": self.clock().isoformat(),
                    "prev_hash": prev,
                }
            )
            outcome, value, *_ = await self._run(
                self._keys(chain, incident.incident_id),
                [
                    "correction",
                    chain,
                    seq,
                    prev,
                    canonical_json(entry),
                    entry["hash"],
                    content_digest,
                    entry_class.value,
                    _text(cur_class),
                    "",
                    "",
                    "",
                    "",
                    0,
                    epoch_us(self.clock()),
                    incident.incident_id,
                ],
            )
            if outcome == "missing":
                raise CorrectionRefused(
                    f"incident {incident.incident_id} is not in the ledger", "incident_id"
                )
            if outcome != "stale":
                if outcome == "ok":
                    self._heads[chain] = (int(value), str(entry["hash"]))
                return AppendResult(outcome, chain, int(value), entry_class)
        raise RuntimeError(f"chain {chain} kept moving during {MAX_APPEND_TRIES} append tries")

    async def amend(self, incident: Incident, reason: str) -> AppendResult:
        """Append what a recorded incident learnt after its close (``amendments.py``).

        Raises:
            NotRecordedYet: the incident has no entry yet (its close is still on the way).
            CorrectionRefused: the amendment moves the incident to another chain, changes
                its class, or changes fields other than ``AMENDABLE``.
        """
        inc_key = self.key("inc", incident.incident_id)
        content = incident.model_dump(mode="json")
        content_digest, entry_class = digest(content), classify(incident)
        not_yet = NotRecordedYet(f"incident {incident.incident_id} is not in the ledger yet")
        for _ in range(MAX_APPEND_TRIES):
            chain_raw, cur_seq, cur_class = await self.redis.hmget(inc_key, "chain", "seq", "class")
            if chain_raw is None:
                raise not_yet
            chain, cur_seq = _text(chain_raw), _text(cur_seq)
            known = await self.redis.hget(inc_key, f"d:{content_digest}")
            if known is not None:
                return AppendResult("exists", chain, int(known), entry_class)
            if entry_class.value != _text(cur_class):
                raise CorrectionRefused(
                    f"the amendment changes how incident {incident.incident_id} counts "
                    f"({_text(cur_class)} to {entry_class.value}); that is a correction",
                    "resolution",
                )
            prior = json.loads(await self.redis.lindex(self.key("chain", chain), int(cur_seq) - 1))
            try:
                fields = amended_fields(prior["incident"], content)
            except AmendmentRefused as exc:
                raise CorrectionRefused(str(exc), "incident") from exc
            seq, prev = await self.head(chain)
            entry = seal(
                {
                    "seq": seq + 1,
                    "chain": chain,
                    "kind": "amendment",
                    "incident_id": incident.incident_id,
                    "class": entry_class.value,
                    "amends_seq": int(cur_seq),
                    "fields": fields,
                    "reason": reason,
                    "incident": content,
                    "digest": content_digest,
                    "recorded_at": self.clock().isoformat(),
                    "prev_hash": prev,
                }
            )
            args: list[Any] = ["amendment", chain, seq, prev, canonical_json(entry), entry["hash"]]
            args += [content_digest, entry_class.value, _text(cur_class), "", "", "", "", 0]
            args += [epoch_us(self.clock()), incident.incident_id, cur_seq]
            outcome, value, *_ = await self._run(self._keys(chain, incident.incident_id), args)
            if outcome == "missing":
                raise not_yet
            if outcome != "stale":
                if outcome == "ok":
                    self._heads[chain] = (int(value), str(entry["hash"]))
                return AppendResult(outcome, chain, int(value), entry_class)
        raise RuntimeError(f"incident {incident.incident_id} kept moving during amendment tries")

    async def _run(self, keys: list[str], args: list[Any]) -> list[str]:
        return [_text(v) for v in await self._append(keys=keys, args=args)]

    # ------------------------------------------------------------------ the guarantee

    async def tally(self, chain: str) -> Tally:
        """The aggregate of a chain (maintained by the append script)."""
        raw = await self.redis.hgetall(self.key("agg", chain))
        return Tally.from_mapping({_text(k): _text(v) for k, v in raw.items()})

    async def guarantee(self, contract_id: str) -> Guarantee:
        """The guarantee of the contract's term: provisional, or the final one once closed."""
        contract = await self.get_contract(contract_id)
        closed = await self.redis.get(self.key("closed", contract_id))
        if closed is not None:
            return Guarantee.model_validate(json.loads(closed)["guarantee"])
        return evaluate(contract, await self.tally(contract_id), final=False)

    async def close_term(self, contract_id: str) -> CloseResult:
        """Evaluate a finished term finally; below the threshold, issue its one credit.

        Idempotent: a second call returns the first call's result. The close is itself an
        entry of the contract's chain, so the evaluation and the credit are evidence too.

        Raises:
            ContractNotFound: no such contract.
            TermNotOver: the term has not ended yet.
        """
        contract = await self.get_contract(contract_id)
        closed_key = self.key("closed", contract_id)
        existing = await self.redis.get(closed_key)
        if existing is None and self.clock() < contract.term_end:
            raise TermNotOver(
                f"the term of {contract_id} ends at {contract.term_end.isoformat()}; close it "
                "after that",
                "contract_id",
            )
        credit_id = credit_id_for(contract_id, contract.term_start)
        for _ in range(MAX_APPEND_TRIES):
            if existing is not None:
                return await self._closed_result(contract, json.loads(existing), False)
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hmget(self.key("head", contract_id), "seq", "hash")
                pipe.hgetall(self.key("agg", contract_id))
                (head_seq, head_hash), agg = await pipe.execute()
            seq = int(head_seq) if head_seq is not None else 0
            prev = _text(head_hash) if head_hash is not None else GENESIS
            tally = Tally.from_mapping({_text(k): _text(v) for k, v in agg.items()})
            final = evaluate(contract, tally, final=True)
            now = self.clock()
            credit = (
                None
                if final.met
                else CreditIssued(
                    event_id=credit_id,
                    source="billing",
                    occurred_at=now,
                    credit_id=credit_id,
                    contract_id=contract_id,
                    tenant=contract.tenant,
                    term_start=contract.term_start,
                    term_end=contract.term_end,
                    amount_minor=final.credit_minor,
                    currency=contract.currency,
                    eligible_failures=final.eligible_failures,
                    resolved_by_migration=final.resolved_by_migration,
                    ratio=final.ratio,
                )
            )
            entry = seal(
                {
                    "seq": seq + 1,
                    "chain": contract_id,
                    "kind": "term_closed",
                    "incident_id": None,
                    "tally": tally.__dict__,
                    "guarantee": final.model_dump(mode="json"),
                    "credit_id": credit.credit_id if credit else None,
                    "recorded_at": now.isoformat(),
                    "prev_hash": prev,
                }
            )
            closed = {
                "seq": seq + 1,
                "hash": entry["hash"],
                "guarantee": final.model_dump(mode="json"),
                "credit_id": credit.credit_id if credit else None,
            }
            record = {
                "credit": credit.model_dump(mode="json") if credit else None,
                "issued_at": now.isoformat(),
                "close_seq": seq + 1,
                "close_hash": entry["hash"],
                "prevented_failures": final.prevented_failures,
                "threshold": final.threshold,
            }
            outcome, value, *_ = await self._run(
                self._keys(contract_id, contract_id=contract_id, credit_id=credit_id),
                [
                    "close",
                    contract_id,
                    seq,
                    prev,
                    canonical_json(entry),
                    entry["hash"],
                    "",
                    "",
                    "",
                    "",
                    canonical_json(closed),
                    canonical_json(record),
                    credit_id if credit else "",
                    epoch_us(now),
                    epoch_us(now),
                    "",
                ],
            )
            if outcome == "ok":
                self._heads[contract_id] = (seq + 1, str(entry["hash"]))
                return await self._closed_result(contract, closed, True)
            if outcome == "exists":
                existing = value
        raise RuntimeError(f"chain {contract_id} kept moving during {MAX_APPEND_TRIES} tries")

    async def _closed_result(
        self, contract: Contract, closed: dict[str, Any], newly: bool
    ) -> CloseResult:
        credit = None
        published = False
        if closed.get("credit_id"):
            record = await self.credit_record(str(closed["credit_id"]))
            credit = CreditIssued.model_validate(record["credit"])
            published = bool(
                await self.redis.sismember(self.key("credit_published"), credit.credit_id)
            )
        del contract
        return CloseResult(
            Guarantee.model_validate(closed["guarantee"]),
            credit,
            newly,
            published,
            int(closed["seq"]),
            str(closed["hash"]),
        )

    async def mark_published(self, credit_id: str) -> None:
        """Remember that the credit's event was acknowledged by JetStream."""
        await self.redis.sadd(self.key("credit_published"), credit_id)

    # ------------------------------------------------------------------ credits

    async def credit_record(self, credit_id: str) -> dict[str, Any]:
        """The stored record of a credit (the event, issue time, close entry hash)."""
        raw = await self.redis.get(self.key("credit", credit_id))
        if raw is None:
            raise LedgerError(f"credit {credit_id} is named by a closed term but missing")
        value: dict[str, Any] = json.loads(raw)
        return value

    async def credits(
        self,
        contract_id: str | None = None,
        tenant: str | None = None,
        start: datetime | None = None,
        end: datetime | None = None,
    ) -> list[dict[str, Any]]:
        """Credit records in issue order, filtered by contract, tenant and issue time."""
        lo = epoch_us(start) if start else "-inf"
        hi = f"({epoch_us(end)}" if end else "+inf"
        ids = [_text(i) for i in await self.redis.zrangebyscore(self.key("credits"), lo, hi)]
        raws = await self.redis.mget([self.key("credit", i) for i in ids]) if ids else []
        out = []
        for raw in raws:
            if raw is None:
                continue
            record = json.loads(raw)
            credit = record["credit"]
            if contract_id and credit["contract_id"] != contract_id:
                continue
            if tenant and credit["tenant"] != tenant:
                continue
            out.append(record)
        return out

    # ------------------------------------------------------------------ reading, verifying

    async def chains(self) -> list[str]:
        """Every chain id, sorted."""
        return sorted(_text(c) for c in await self.redis.smembers(self.key("chains")))

    async def raw_entries(self, chain: str) -> AsyncIterator[bytes]:
        """The stored entry texts of a chain, in order."""
        key = self.key("chain", chain)
        start = 0
        while True:
            batch = await self.redis.lrange(key, start, start + VERIFY_CHUNK - 1)
            for raw in batch:
                yield raw
            if len(batch) < VERIFY_CHUNK:
                return
            start += VERIFY_CHUNK

    async def entries(self, chain: str) -> list[dict[str, Any]]:
        """The parsed entries of a chain, in order."""
        return [json.loads(raw) async for raw in self.raw_entries(chain)]

    async def verify(self, contract_id: str | None = None) -> dict[str, Any]:
        """Recompute the hash chain (one contract's, or every chain) and the aggregates.

        Returns ``{ok, checked, chains, first_bad?}``; ``first_bad`` names the first entry
        that does not match: ``{contract_id, incident_id, seq, reason}``.
        """
        if contract_id is not None:
            await self.get_contract(contract_id)
            chains = [contract_id]
        else:
            chains = await self.chains()
        checked = 0
        for chain in chains:
            bad = await self._verify_chain(chain)
            checked += bad[0]
            if bad[1] is not None:
                return {
                    "ok": False,
                    "checked": checked,
                    "chains": len(chains),
                    "first_bad": bad[1].as_dict(),
                }
        return {"ok": True, "checked": checked, "chains": len(chains)}

    async def _verify_chain(self, chain: str) -> tuple[int, BadEntry | None]:
        # The chain is read in several round trips; an append landing meanwhile makes the
        # head or the aggregates look inconsistent. A verdict of "bad" counts only if the
        # head did not move while we read; otherwise read again.
        result: tuple[int, BadEntry | None] = (0, None)
        for _ in range(5):
            before = await self.head(chain)
            result = await self._verify_chain_once(chain)
            if result[1] is None or await self.head(chain) == before:
                return result
        return result

    async def _verify_chain_once(self, chain: str) -> tuple[int, BadEntry | None]:
        verifier = ChainVerifier(chain)
        effective: dict[str, EntryClass] = {}
        latest: dict[str, tuple[int, str, dict[str, Any]]] = {}
        async for raw in self.raw_entries(chain):
            entry = verifier.feed(raw)
            if entry is None:
                return verifier.checked, verifier.bad
            kind, incident_id = entry.get("kind"), str(entry.get("incident_id"))
            if kind == "amendment":
                problem = amendment_problem(entry, latest.get(incident_id))
                if problem is not None:
                    return verifier.checked - 1, BadEntry(chain, incident_id, entry["seq"], problem)
            if kind in ("incident", "correction", "amendment"):
                effective[incident_id] = EntryClass(entry["class"])
                latest[incident_id] = (int(entry["seq"]), str(entry["class"]), entry["incident"])
        head_seq, head_hash = await self.head(chain)
        if not verifier.check_head(head_seq, head_hash):
            return verifier.checked, verifier.bad
        stored = await self.tally(chain)
        recomputed = Tally.of(tuple(effective.values()))
        if stored != recomputed:
            return verifier.checked, BadEntry(
                chain,
                None,
                None,
                f"aggregates {stored.__dict__} differ from the entries' {recomputed.__dict__} "
                "(the aggregate was altered)",
            )
        return verifier.checked, None


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode()
    return str(value)
