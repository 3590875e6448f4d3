"""The guarantee's business rules as pure functions: what counts, the ratio, the credit.

Nothing here touches Redis or NATS; the ledger and the service call these functions, and the
unit tests check them without any server.

What counts (docs/design.md §8):
- An incident whose ``fault_kind`` is ``application_error`` or whose resolution is
  ``excluded`` is not an infrastructure failure: it is recorded but never eligible.
- ``migrated_live`` is a failure resolved by live migration.
- ``migrated_proactive`` is a *prevented* failure (the rank moved before it failed). It is
  reported always, and counted in the ratio (as eligible and as resolved) only when the
  contract says ``count_proactive``.
- Every other resolution (``checkpoint_restart``, ``shrunk``, ``manual``, ``lost``, and an
  ``open`` incident that was closed without a resolution) is an eligible failure that was
  not resolved by migration.

Money: the credit is ``credit_rate * renewal_fee_minor`` computed exactly (the rate is read
as the decimal it was written as, so 0.25 is exactly 1/4) and rounded half-up to an
integer number of minor units: 0.5 minor units and above go up, below go down.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from fractions import Fraction
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from torchrelay.contract import (
    Contract,
    FaultKind,
    Guarantee,
    Incident,
    Message,
    Name,
    Resolution,
    Token,
    UtcDatetime,
    make_event_id,
)

from .currencies import is_currency

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class EntryClass(StrEnum):
    """How one incident counts for the guarantee."""

    RESOLVED = "resolved"  # migrated_live
    UNRESOLVED = "unresolved"  # an eligible failure not resolved by migration
    PREVENTED = "prevented"  # migrated_proactive
    EXCLUDED = "excluded"  # application error or resolution excluded


ENTRY_CLASSES = tuple(EntryClass)


def classify(incident: Incident) -> EntryClass:
    """How ``incident`` counts for the guarantee (see the module docstring)."""
    if incident.fault_kind == FaultKind.APPLICATION_ERROR:
        return EntryClass.EXCLUDED
    if incident.resolution == Resolution.EXCLUDED:
        return EntryClass.EXCLUDED
    if incident.resolution == Resolution.MIGRATED_LIVE:
        return EntryClass.RESOLVED
    if incident.resolution == Resolution.MIGRATED_PROACTIVE:
        return EntryClass.PREVENTED
    return EntryClass.UNRESOLVED


@dataclass(frozen=True)
class Tally:
    """Counts of a term's incidents by class (the ledger's per-term aggregate)."""

    resolved: int = 0
    unresolved: int = 0
    prevented: int = 0
    excluded: int = 0

    @classmethod
    def of(cls, classes: list[EntryClass] | tuple[EntryClass, ...]) -> Tally:
        """The tally of a list of classes."""
        return cls(**{c.value: sum(1 for x in classes if x == c) for c in EntryClass})

    @classmethod
    def from_mapping(cls, raw: dict[str, Any]) -> Tally:
        """A tally from a mapping of class name to count (missing classes count 0)."""
        return cls(**{c.value: int(raw.get(c.value, 0) or 0) for c in EntryClass})


def counted(tally: Tally, count_proactive: bool) -> tuple[int, int]:
    """``(eligible_failures, resolved_by_migration)`` of a tally under a contract's rule."""
    eligible = tally.resolved + tally.unresolved
    resolved = tally.resolved
    if count_proactive:
        eligible += tally.prevented
        resolved += tally.prevented
    return eligible, resolved


def exact(value: float) -> Fraction:
    """A float as the decimal it was written as (0.9 → 9/10, not the nearest binary)."""
    return Fraction(repr(value))


def meets(resolved: int, eligible: int, threshold: float) -> bool:
    """True when ``resolved / eligible ≥ threshold``, exactly; no failures meets it."""
    if eligible == 0:
        return True
    return Fraction(resolved, eligible) >= exact(threshold)


def round_half_up(value: Fraction) -> int:
    """Round a non-negative exact amount to the nearest integer, halves up."""
    return int((value + Fraction(1, 2)) // 1)


def credit_minor(renewal_fee_minor: int, credit_rate: float) -> int:
    """The credit of a missed term: ``credit_rate * renewal_fee_minor``, rounded half-up."""
    return round_half_up(exact(credit_rate) * renewal_fee_minor)


def evaluate(contract: Contract, tally: Tally, *, final: bool) -> Guarantee:
    """The guarantee of ``contract``'s term from the tally of its incidents."""
    eligible, resolved = counted(tally, contract.count_proactive)
    met = meets(resolved, eligible, contract.threshold)
    return Guarantee(
        contract_id=contract.contract_id,
        term_start=contract.term_start,
        term_end=contract.term_end,
        eligible_failures=eligible,
        resolved_by_migration=resolved,
        prevented_failures=tally.prevented,
        ratio=1.0 if eligible == 0 else resolved / eligible,
        threshold=contract.threshold,
        met=met,
        credit_minor=0 if met else credit_minor(contract.renewal_fee_minor, contract.credit_rate),
        currency=contract.currency,
        final=final,
    )


def covers(contract: Contract, instant: datetime) -> bool:
    """True when ``instant`` lies in the term ``[term_start, term_end)`` (UTC).

    The start instant belongs to the term, the end instant to the next one, so an incident
    detected exactly at a boundary counts once, in the term that starts there.
    """
    return contract.term_start <= instant < contract.term_end


def epoch_us(instant: datetime) -> int:
    """Microseconds since the Unix epoch (exact, for Redis scores)."""
    return (instant - EPOCH) // timedelta(microseconds=1)


def from_epoch_us(value: int) -> datetime:
    """The UTC instant of ``epoch_us``."""
    return EPOCH + timedelta(microseconds=value)


def contract_id_for(tenant: str, term_start: datetime) -> str:
    """The deterministic id of a tenant's contract starting at ``term_start``.

    A tenant's terms never overlap, so (tenant, term start) names one contract, and a
    retried create names the same one.
    """
    return "ct-" + make_event_id("contract", tenant, term_start.isoformat())[:20]


def credit_id_for(contract_id: str, term_start: datetime) -> str:
    """The deterministic id (and event id) of the one credit a term can produce."""
    return "cr-" + make_event_id("credit", contract_id, term_start.isoformat())[:24]


class ContractInvalid(ValueError):
    """A contract request is invalid; ``field`` names the offending field."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ContractRequest(Message):
    """The body of ``contract_create`` (docs/interfaces.md), validated field by field."""

    contract_id: Name | None = None
    tenant: Token
    term_start: UtcDatetime
    term_end: UtcDatetime
    renewal_fee_minor: int = Field(ge=0, strict=True)
    currency: str
    threshold: float = Field(default=0.9, gt=0, le=1)
    credit_rate: float = Field(default=0.25, ge=0, le=1)
    count_proactive: bool = False
    price_per_gpu_hour_minor: int | None = Field(default=None, ge=0, strict=True)

    @field_validator("currency")
    @classmethod
    def _iso_4217(cls, value: str) -> str:
        if not is_currency(value):
            raise ValueError(
                f"{value!r} is not an ISO 4217 currency code with minor units "
                "(e.g. USD, EUR, JPY); use the upper-case alphabetic code"
            )
        return value

    @field_validator("term_end")
    @classmethod
    def _after_start(cls, value: datetime, info: ValidationInfo) -> datetime:
        start = info.data.get("term_start")
        if isinstance(start, datetime) and value <= start:
            raise ValueError(
                f"term_end {value.isoformat()} must be after term_start {start.isoformat()}"
            )
        return value

    def to_contract(self) -> Contract:
        """The contract this request creates (its id derived when not given)."""
        cid = self.contract_id or contract_id_for(self.tenant, self.term_start)
        return Contract(
            contract_id=cid,
            tenant=self.tenant,
            term_start=self.term_start,
            term_end=self.term_end,
            renewal_fee_minor=self.renewal_fee_minor,
            currency=self.currency,
            threshold=self.threshold,
            credit_rate=self.credit_rate,
            count_proactive=self.count_proactive,
            price_per_gpu_hour_minor=self.price_per_gpu_hour_minor,
        )


_PERIOD = re.compile(r"^(\d{4})-(0[1-9]|1[0-2])$")


def billing_period(period: str) -> tuple[datetime, datetime]:
    """``[start, end)`` in UTC of a billing period written ``YYYY-MM``.

    Raises:
        ContractInvalid: the period is not ``YYYY-MM`` (field ``period``).
    """
    match = _PERIOD.match(period)
    if not match:
        raise ContractInvalid(f"period {period!r} must be YYYY-MM, e.g. 2026-01", "period")
    year, month = int(match.group(1)), int(match.group(2))
    start = datetime(year, month, 1, tzinfo=UTC)
    end = datetime(year + (month == 12), month % 12 + 1, 1, tzinfo=UTC)
    return start, end
