"""The billing service: closed incidents into the ledger, and the billing RPC verbs.

Consumes ``IncidentClosed`` and ``IncidentAmended`` on the durable consumer ``billing`` (an
amendment: a restart's lost steps and stall, learnt after the close) and answers
``tr.rpc.billing.<verb>`` for the verbs of ``contract.RPC_VERBS["billing"]`` (plus
``ledger_correct``, the operator's way to append a correction).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client import Counter
from pydantic import Field

from torchrelay.bus import (
    BusError,
    Conflict,
    Delivery,
    NotFound,
    PermanentError,
    RequestInvalid,
)
from torchrelay.contract import (
    Event,
    Incident,
    IncidentAmended,
    IncidentClosed,
    Message,
    Subjects,
    UtcDatetime,
)
from torchrelay.service import ServiceContext

from .focus import credit_row, render
from .gauges import GUARANTEE_GAUGE_INTERVAL_S, GuaranteeGauges
from .ledger import (
    CloseResult,
    ContractConflict,
    ContractNotFound,
    CorrectionRefused,
    Ledger,
    LedgerError,
    TermNotOver,
)
from .rules import ContractInvalid, ContractRequest, billing_period

log = logging.getLogger("torchrelay.billing")


class ContractRef(Message):
    contract_id: str = Field(min_length=1, max_length=128)


class GuaranteeRequest(ContractRef):
    at: UtcDatetime | None = None


class ContractListRequest(Message):
    tenant: str | None = None
    limit: int = Field(default=100, ge=1, le=1000)
    cursor: str | None = Field(default=None, pattern=r"^\d+$")


class CreditsRequest(Message):
    contract_id: str | None = None
    tenant: str | None = None


class ExportRequest(Message):
    period: str
    format: str = Field(default="csv", pattern=r"^(csv|json)$")


class VerifyRequest(Message):
    contract_id: str | None = None


class CorrectionRequest(Message):
    incident: Incident
    reason: str = Field(min_length=1, max_length=2000)


def _refusal(exc: LedgerError) -> RequestInvalid:
    if isinstance(exc, ContractNotFound):
        return NotFound(str(exc), exc.field)
    if isinstance(exc, ContractConflict | TermNotOver):
        return Conflict(str(exc), exc.field)
    return RequestInvalid(str(exc), exc.field)


class BillingService:
    """The handlers of the billing service over one ledger."""

    def __init__(self, ctx: ServiceContext, ledger: Ledger) -> None:
        self.ctx = ctx
        self.ledger = ledger
        registry = ctx.metrics.registry
        self.appends = Counter(
            "torchrelay_ledger_appends_total",
            "Ledger append attempts by outcome (ok, exists, conflict)",
            ["outcome"],
            registry=registry,
        )
        self.credits_issued = Counter(
            "torchrelay_credits_issued_total",
            "Guarantee credits issued at a term's close",
            registry=registry,
        )
        self.gauges = GuaranteeGauges(ledger, registry)

    async def on_event(self, event: Event, delivery: Delivery) -> None:
        """Record a closed incident; a conflicting redelivery goes to the dead letters."""
        del delivery
        if isinstance(event, IncidentAmended):
            await self.on_amended(event)
            return
        if not isinstance(event, IncidentClosed):
            return  # IncidentOpened: the ledger records incidents once they are closed
        result = await self.ledger.record(event.incident)
        self.appends.labels(result.outcome).inc()
        if result.outcome == "ok":
            await self._show_guarantee(result.chain)
        if result.outcome == "conflict":
            raise PermanentError(
                f"ledger conflict: incident {event.incident.incident_id} is already recorded "
                f"(chain {result.chain}, seq {result.seq}) with other content; the original is "
                "kept and this version is recorded as a conflict"
            )

    async def on_amended(self, event: IncidentAmended) -> None:
        """Append an amendment; one that arrives before its incident's entry is redelivered
        later (NotRecordedYet is not permanent), one that would change more is refused."""
        try:
            result = await self.ledger.amend(event.incident, event.reason)
        except CorrectionRefused as exc:
            self.appends.labels("refused").inc()
            raise PermanentError(f"ledger amendment refused: {exc}") from exc
        self.appends.labels(result.outcome).inc()

    # ------------------------------------------------------------------ contracts

    async def contract_create(self, body: dict[str, Any]) -> Any:
        request = ContractRequest.model_validate(body)
        try:
            contract, _ = await self.ledger.create_contract(request)
        except LedgerError as exc:
            raise _refusal(exc) from exc
        self.gauges.track(contract)
        await self._show_guarantee(contract.contract_id)
        return contract

    async def contract_get(self, body: dict[str, Any]) -> Any:
        ref = ContractRef.model_validate(body)
        try:
            return await self.ledger.get_contract(ref.contract_id)
        except LedgerError as exc:
            raise _refusal(exc) from exc

    async def contract_list(self, body: dict[str, Any]) -> Any:
        req = ContractListRequest.model_validate(body)
        items, cursor = await self.ledger.list_contracts(req.tenant, req.limit, req.cursor)
        return {"items": items, "next_cursor": cursor}

    # ------------------------------------------------------------------ the guarantee

    async def guarantee(self, body: dict[str, Any]) -> Any:
        req = GuaranteeRequest.model_validate(body)
        try:
            contract = await self.ledger.get_contract(req.contract_id)
            if req.at is not None and not (contract.term_start <= req.at <= contract.term_end):
                raise NotFound(
                    f"contract {req.contract_id} has no term containing {req.at.isoformat()} "
                    f"(its term is {contract.term_start.isoformat()} to "
                    f"{contract.term_end.isoformat()})",
                    "at",
                )
            return await self.ledger.guarantee(req.contract_id)
        except LedgerError as exc:
            raise _refusal(exc) from exc

    async def close_term(self, body: dict[str, Any]) -> Any:
        ref = ContractRef.model_validate(body)
        try:
            result = await self.ledger.close_term(ref.contract_id)
        except LedgerError as exc:
            raise _refusal(exc) from exc
        await self.publish_credit(result)
        return {
            "guarantee": result.guarantee,
            "credit": result.credit,
            "closed_now": result.newly_closed,
            "ledger_seq": result.close_seq,
            "ledger_hash": result.close_hash,
        }

    async def publish_credit(self, result: CloseResult) -> None:
        """Publish the term's CreditIssued until JetStream acknowledges it once.

        The event id is the credit id, so a republish after a crash is deduplicated by
        JetStream and by every consumer.
        """
        if result.credit is None or result.published:
            return
        await self.ctx.bus.publish(result.credit, Subjects.CREDIT_ISSUED)
        await self.ledger.mark_published(result.credit.credit_id)
        if result.newly_closed:
            self.credits_issued.inc()

    async def republish_pending(self) -> None:
        """Publish credits recorded but not acknowledged (a crash between the two)."""
        for record in await self.ledger.credits():
            contract_id = record["credit"]["contract_id"]
            result = await self.ledger.close_term(contract_id)
            if not result.published:
                log.info("republishing credit %s", record["credit"]["credit_id"])
                await self.publish_credit(result)

    async def credits_list(self, body: dict[str, Any]) -> Any:
        req = CreditsRequest.model_validate(body)
        records = await self.ledger.credits(req.contract_id, req.tenant)
        items = [
            {
                **r["credit"],
                "issued_at": r["issued_at"],
                "ledger_seq": r["close_seq"],
                "ledger_hash": r["close_hash"],
            }
            for r in records
        ]
        return {"items": items, "next_cursor": None}

    # ------------------------------------------------------------------ export, verify

    async def export(self, body: dict[str, Any]) -> Any:
        req = ExportRequest.model_validate(body)
        try:
            start, end = billing_period(req.period)
        except ContractInvalid as exc:
            raise RequestInvalid(str(exc), exc.field) from exc
        records = await self.ledger.credits(start=start, end=end)
        rows = [credit_row(r, start, end, await self.term_goodput(r["credit"])) for r in records]
        heads = {}
        for record in records:
            cid = record["credit"]["contract_id"]
            seq, hash_ = await self.ledger.head(cid)
            heads[cid] = {"seq": seq, "hash": hash_}
        content_type, text = render(rows, req.format)
        return {
            "period": req.period,
            "format": req.format,
            "content_type": content_type,
            "body": text,
            "rows": len(rows),
            "chain_heads": heads,
        }

    async def term_goodput(self, credit: dict[str, Any]) -> dict[str, Any] | None:
        """The tenant's goodput over the credit's term, priced at its contract's price (the
        scheduler's ``tenant_goodput``); None, and empty columns, when it does not answer."""
        body: dict[str, Any] = {
            "tenant": credit["tenant"],
            "from": credit["term_start"],
            "to": credit["term_end"],
        }
        try:
            contract = await self.ledger.get_contract(str(credit["contract_id"]))
            if contract.price_per_gpu_hour_minor is not None:
                body["price_per_gpu_hour_minor"] = contract.price_per_gpu_hour_minor
                body["currency"] = contract.currency
            answer: dict[str, Any] = await self.ctx.bus.request(
                Subjects.rpc("scheduler", "tenant_goodput"), body, timeout=5.0
            )
        except (BusError, LedgerError) as exc:
            log.warning("no goodput for the term of %s: %s", credit["contract_id"], exc)
            return None
        return answer

    async def ledger_verify(self, body: dict[str, Any]) -> Any:
        req = VerifyRequest.model_validate(body)
        try:
            return await self.ledger.verify(req.contract_id)
        except LedgerError as exc:
            raise _refusal(exc) from exc

    async def ledger_correct(self, body: dict[str, Any]) -> Any:
        req = CorrectionRequest.model_validate(body)
        try:
            result = await self.ledger.correct(req.incident, req.reason)
        except (CorrectionRefused, LedgerError) as exc:
            raise _refusal(exc) from exc
        if result.outcome == "ok":
            await self._show_guarantee(result.chain)
        return {"outcome": result.outcome, "chain": result.chain, "seq": result.seq}

    # ------------------------------------------------------------------ the gauges

    async def _show_guarantee(self, chain: str) -> None:
        # The ledger write is done; a gauge that failed to refresh must not fail it (nor
        # send the event round again): the periodic refresh catches up.
        try:
            await self.gauges.refresh(chain)
        except Exception as exc:
            log.warning("guarantee gauge of %s not refreshed: %r", chain, exc)

    async def guarantee_gauge_loop(self) -> None:
        """Refresh the guarantee gauges every ``GUARANTEE_GAUGE_INTERVAL_S`` (terms begin and
        end without an event)."""
        while True:
            try:
                await self.gauges.refresh()
            except Exception as exc:
                log.warning("guarantee gauges not refreshed: %r", exc)
            await asyncio.sleep(GUARANTEE_GAUGE_INTERVAL_S)


async def ledger_durability(ctx: ServiceContext) -> str:
    """Redis' ``appendfsync`` as this service sees it; warns unless it is ``always``.

    An acknowledged ledger entry must survive a crash of Redis (docs/design.md §8). Managed Redis
    may refuse CONFIG; then the setting is reported as unknown.
    """
    try:
        raw: dict[Any, Any] = {
            **(await ctx.redis.config_get("appendfsync")),
            **(await ctx.redis.config_get("appendonly")),
        }
    except Exception:
        return "unknown (CONFIG GET refused)"
    config = {_decode(k): _decode(v) for k, v in raw.items()}
    fsync, appendonly = config.get("appendfsync", "?"), config.get("appendonly", "?")
    if appendonly != "yes" or fsync != "always":
        log.warning(
            "Redis runs with appendonly=%s appendfsync=%s: an acknowledged ledger entry can "
            "be lost if Redis crashes; run it with --appendonly yes --appendfsync always",
            appendonly,
            fsync,
        )
    return f"appendonly={appendonly} appendfsync={fsync}"


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def setup(ctx: ServiceContext) -> None:
    """Register the billing consumer and RPC verbs on ``ctx``."""
    ctx.readiness["ledger_durability"] = await ledger_durability(ctx)
    ledger = Ledger(ctx.redis, ctx.prefix)
    service = BillingService(ctx, ledger)
    await service.gauges.load()
    await ctx.consume("billing", service.on_event)
    for verb in (
        "contract_create",
        "contract_get",
        "contract_list",
        "guarantee",
        "close_term",
        "credits_list",
        "export",
        "ledger_verify",
        "ledger_correct",
    ):
        await ctx.serve(verb, getattr(service, verb))
    ctx.readiness["ledger"] = "ok"
    ctx.spawn(service.republish_pending(), "billing-republish")
    ctx.spawn(service.guarantee_gauge_loop(), "billing-guarantee-gauges")
