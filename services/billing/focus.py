"""The billing export: FOCUS 1.2 rows for the guarantee credits of a billing period.

One row per credit issued in the period (by its issue time, UTC). A credit is a
``ChargeCategory`` ``Credit`` row with a negative ``BilledCost``; FOCUS says a charge that is
not derived from other charges has ``EffectiveCost``, ``ListCost`` and ``ContractedCost``
equal to its ``BilledCost``, so all four carry the same amount. ``PricingQuantity`` and
``PricingUnit`` are null (a credit has no priced quantity), ``ChargeClass`` is null (not a
correction of an earlier period), ``ChargeFrequency`` is ``One-Time``. The charge period is
the UTC day the credit was issued (inside the billing period); the term it compensates is
in ``x_TermStart``/``x_TermEnd``.

Columns: every FOCUS 1.2 mandatory column, the 1.2 conditional/recommended columns that
apply (null where they do not), and, for compatibility with the PyPI ``focus-validator``
1.0.0 (which checks FOCUS 1.0 and still spells four columns the 1.0-preview way),
``InvoiceIssuer``, ``Provider``, ``Publisher`` and ``ResourceID`` next to their 1.2 names.
The evidence is in ``x_`` columns, including ``x_LedgerChainHead``: the hash of the ledger
entry that closed the term, which ``torchrelay ledger verify`` can check later.
Amounts are decimals in the billing currency with its ISO 4217 decimals (strings in JSON
so that no binary float rounds them).
"""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta
from typing import Any

from .currencies import to_decimal

PROVIDER = "torchrelay"
SERVICE_NAME = "torchrelay live-migration guarantee"

FOCUS_COLUMNS = (
    "AvailabilityZone",
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingAccountType",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "CapacityReservationId",
    "CapacityReservationStatus",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargeFrequency",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "CommitmentDiscountCategory",
    "CommitmentDiscountId",
    "CommitmentDiscountName",
    "CommitmentDiscountQuantity",
    "CommitmentDiscountStatus",
    "CommitmentDiscountType",
    "CommitmentDiscountUnit",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedCost",
    "ContractedUnitPrice",
    "EffectiveCost",
    "InvoiceId",
    "InvoiceIssuer",
    "InvoiceIssuerName",
    "ListCost",
    "ListUnitPrice",
    "PricingCategory",
    "PricingCurrency",
    "PricingQuantity",
    "PricingUnit",
    "Provider",
    "ProviderName",
    "Publisher",
    "PublisherName",
    "RegionId",
    "RegionName",
    "ResourceID",
    "ResourceName",
    "ResourceType",
    "ServiceCategory",
    "ServiceName",
    "ServiceSubcategory",
    "SkuId",
    "SkuMeter",
    "SkuPriceDetails",
    "SkuPriceId",
    "SubAccountId",
    "SubAccountName",
    "SubAccountType",
    "Tags",
)
EVIDENCE_COLUMNS = (
    "x_ContractId",
    "x_CreditId",
    "x_TermStart",
    "x_TermEnd",
    "x_Failures",
    "x_Migrated",
    "x_Prevented",
    "x_Ratio",
    "x_Threshold",
    "x_CreditMinor",
    "x_LedgerSeq",
    "x_LedgerChainHead",
    # The tenant's goodput over the term (docs/design.md §14), null when the scheduler did
    # not answer: GPU-seconds allocated, of progress and lost to incidents, ETTR, and what
    # checkpoint restart would have cost, as GPU-hours and minor units saved.
    "x_GpuSecondsAllocated",
    "x_GpuSecondsProgress",
    "x_GpuSecondsLost",
    "x_Ettr",
    "x_CounterfactualGpuSecondsLost",
    "x_GpuHoursSaved",
    "x_MoneySavedMinor",
)
COLUMNS = FOCUS_COLUMNS + EVIDENCE_COLUMNS


def iso_utc(instant: datetime) -> str:
    """UTC ISO 8601 with a ``Z`` suffix, as FOCUS's date/time format asks."""
    return instant.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(UTC)


def goodput_columns(goodput: dict[str, Any] | None) -> dict[str, str | None]:
    """The ``x_`` goodput columns of a term from the scheduler's ``tenant_goodput`` answer."""
    if goodput is None:
        return {}
    cf = goodput.get("counterfactual") or {}

    def text(value: Any) -> str | None:
        return None if value is None else str(value)

    return {
        "x_GpuSecondsAllocated": text(goodput.get("gpu_seconds_allocated")),
        "x_GpuSecondsProgress": text(goodput.get("gpu_seconds_progress")),
        "x_GpuSecondsLost": text(goodput.get("gpu_seconds_lost")),
        "x_Ettr": text(goodput.get("ettr")),
        "x_CounterfactualGpuSecondsLost": text(cf.get("gpu_seconds_lost")),
        "x_GpuHoursSaved": text(cf.get("gpu_hours_saved")),
        "x_MoneySavedMinor": text(cf.get("money_saved_minor")),
    }


def credit_row(
    record: dict[str, Any],
    period_start: datetime,
    period_end: datetime,
    goodput: dict[str, Any] | None = None,
) -> dict[str, str | None]:
    """The FOCUS row of one stored credit record (see ``Ledger.close_term``), with the
    tenant's goodput over the term when given (``goodput_columns``)."""
    credit = record["credit"]
    currency = str(credit["currency"])
    amount = str(to_decimal(-int(credit["amount_minor"]), currency))
    issued = _parse(record["issued_at"])
    day = issued.replace(hour=0, minute=0, second=0, microsecond=0)
    term_start, term_end = _parse(credit["term_start"]), _parse(credit["term_end"])
    ratio = float(credit["ratio"])
    threshold = float(record.get("threshold", 0.0))
    description = (
        f"Guarantee credit for term {iso_utc(term_start)} to {iso_utc(term_end)}: "
        f"{credit['resolved_by_migration']} of {credit['eligible_failures']} failures resolved "
        f"by live migration ({ratio:.2%}, below the {threshold:.2%} guaranteed)"
    )
    row: dict[str, str | None] = dict.fromkeys(COLUMNS)
    row.update(
        {
            "BilledCost": amount,
            "BillingAccountId": credit["tenant"],
            "BillingAccountName": credit["tenant"],
            "BillingAccountType": "Tenant",
            "BillingCurrency": currency,
            "BillingPeriodStart": iso_utc(period_start),
            "BillingPeriodEnd": iso_utc(period_end),
            "ChargeCategory": "Credit",
            "ChargeDescription": description,
            "ChargeFrequency": "One-Time",
            "ChargePeriodStart": iso_utc(day),
            "ChargePeriodEnd": iso_utc(day + timedelta(days=1)),
            "ContractedCost": amount,
            "EffectiveCost": amount,
            "InvoiceIssuer": PROVIDER,
            "InvoiceIssuerName": PROVIDER,
            "ListCost": amount,
            "Provider": PROVIDER,
            "ProviderName": PROVIDER,
            "Publisher": PROVIDER,
            "PublisherName": PROVIDER,
            "ServiceCategory": "Compute",
            "ServiceName": SERVICE_NAME,
            "SubAccountId": credit["contract_id"],
            "SubAccountName": f"contract {credit['contract_id']}",
            "SubAccountType": "Contract",
            "Tags": json.dumps({"torchrelay/contract": credit["contract_id"]}, sort_keys=True),
            "x_ContractId": credit["contract_id"],
            "x_CreditId": credit["credit_id"],
            "x_TermStart": iso_utc(term_start),
            "x_TermEnd": iso_utc(term_end),
            "x_Failures": str(credit["eligible_failures"]),
            "x_Migrated": str(credit["resolved_by_migration"]),
            "x_Prevented": str(record.get("prevented_failures", 0)),
            "x_Ratio": f"{ratio:.6f}",
            "x_Threshold": f"{threshold:.6f}",
            "x_CreditMinor": str(credit["amount_minor"]),
            "x_LedgerSeq": str(record["close_seq"]),
            "x_LedgerChainHead": str(record["close_hash"]),
            **goodput_columns(goodput),
        }
    )
    return row


def to_csv(rows: list[dict[str, str | None]]) -> str:
    """The rows as CSV (header always present; null is an empty field)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(COLUMNS), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return out.getvalue()


def to_json(rows: list[dict[str, str | None]]) -> str:
    """The rows as a JSON array of objects (null stays null)."""
    return json.dumps(rows, ensure_ascii=False, indent=None)


def render(rows: list[dict[str, str | None]], fmt: str) -> tuple[str, str]:
    """``(content_type, body)`` of the export in ``fmt`` (``csv`` or ``json``)."""
    if fmt == "csv":
        return "text/csv; charset=utf-8", to_csv(rows)
    return "application/json", to_json(rows)
