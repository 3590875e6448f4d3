"""The hash chain's verifier and the FOCUS rows, without servers."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime
from decimal import Decimal

from services.billing.chain import GENESIS, canonical_json, seal, verify_entries
from services.billing.currencies import MINOR_UNITS, is_currency, to_decimal
from services.billing.focus import COLUMNS, credit_row, render


def chain_of(n: int) -> list[dict[str, object]]:
    entries: list[dict[str, object]] = []
    prev = GENESIS
    for seq in range(1, n + 1):
        entry = seal({"seq": seq, "incident_id": f"i{seq}", "class": "resolved", "prev_hash": prev})
        entries.append(entry)
        prev = str(entry["hash"])
    return entries


def texts(entries: list[dict[str, object]]) -> list[str]:
    return [canonical_json(e) for e in entries]


def test_an_untouched_chain_verifies() -> None:
    entries = chain_of(5)
    v = verify_entries("c1", texts(entries))
    assert v.bad is None
    assert v.checked == 5
    assert v.check_head(5, str(entries[-1]["hash"]))


def test_an_altered_entry_is_named() -> None:
    entries = chain_of(5)
    entries[2] = {**entries[2], "class": "unresolved"}
    v = verify_entries("c1", texts(entries))
    assert v.bad is not None
    assert (v.bad.seq, v.bad.incident_id) == (3, "i3")
    assert "does not match its hash" in v.bad.reason


def test_a_rewritten_entry_with_a_recomputed_hash_is_named() -> None:
    entries = chain_of(5)
    entries[1] = seal({**entries[1], "class": "unresolved"})
    v = verify_entries("c1", texts(entries))
    assert v.bad is not None
    assert (v.bad.seq, v.bad.incident_id) == (2, "i2")


def test_a_removed_last_entry_is_caught_by_the_head() -> None:
    entries = chain_of(5)
    v = verify_entries("c1", texts(entries[:-1]))
    assert v.bad is None
    assert not v.check_head(5, str(entries[-1]["hash"]))
    assert v.bad is not None


def test_a_removed_middle_entry_is_named() -> None:
    entries = chain_of(5)
    v = verify_entries("c1", texts(entries[:2] + entries[3:]))
    assert v.bad is not None
    assert v.bad.seq == 3


def test_currencies() -> None:
    assert is_currency("USD")
    assert is_currency("JPY")
    assert is_currency("KWD")
    assert not is_currency("XAU")
    assert not is_currency("XXX")
    assert not is_currency("ABC")
    assert len(MINOR_UNITS) > 150
    assert str(to_decimal(-250_000, "USD")) == "-2500.00"
    assert str(to_decimal(-2500, "JPY")) == "-2500"
    assert str(to_decimal(-1, "KWD")) == "-0.001"


RECORD = {
    "credit": {
        "event_id": "cr-1",
        "credit_id": "cr-1",
        "contract_id": "ct-1",
        "tenant": "acme",
        "term_start": "2026-01-01T00:00:00Z",
        "term_end": "2026-04-01T00:00:00Z",
        "amount_minor": 250_001,
        "currency": "EUR",
        "eligible_failures": 10,
        "resolved_by_migration": 8,
        "ratio": 0.8,
    },
    "issued_at": "2026-04-02T10:11:12.123456+00:00",
    "close_seq": 11,
    "close_hash": "ab" * 32,
    "prevented_failures": 3,
    "threshold": 0.9,
}


def test_credit_row_is_a_negative_credit_with_equal_costs() -> None:
    start, end = datetime(2026, 4, 1, tzinfo=UTC), datetime(2026, 5, 1, tzinfo=UTC)
    row = credit_row(RECORD, start, end)
    assert set(row) == set(COLUMNS)
    assert row["ChargeCategory"] == "Credit"
    assert row["BilledCost"] == "-2500.01"
    assert row["EffectiveCost"] == row["ListCost"] == row["ContractedCost"] == "-2500.01"
    assert Decimal(str(row["BilledCost"])) < 0
    assert row["BillingCurrency"] == "EUR"
    assert (row["BillingPeriodStart"], row["BillingPeriodEnd"]) == (
        "2026-04-01T00:00:00Z",
        "2026-05-01T00:00:00Z",
    )
    assert (row["ChargePeriodStart"], row["ChargePeriodEnd"]) == (
        "2026-04-02T00:00:00Z",
        "2026-04-03T00:00:00Z",
    )
    assert (row["x_Failures"], row["x_Migrated"], row["x_Prevented"]) == ("10", "8", "3")
    assert row["x_LedgerChainHead"] == "ab" * 32
    assert (row["x_TermStart"], row["x_TermEnd"]) == (
        "2026-01-01T00:00:00Z",
        "2026-04-01T00:00:00Z",
    )
    assert row["PricingQuantity"] is None
    assert row["PricingUnit"] is None
    assert json.loads(str(row["Tags"])) == {"torchrelay/contract": "ct-1"}
    assert row["x_GpuSecondsAllocated"] is None  # no goodput given: the columns are null


def test_credit_row_carries_the_terms_goodput() -> None:
    start, end = datetime(2026, 4, 1, tzinfo=UTC), datetime(2026, 5, 1, tzinfo=UTC)
    goodput = {
        "gpu_seconds_allocated": 100.0,
        "gpu_seconds_progress": 90.5,
        "gpu_seconds_lost": 9.5,
        "ettr": 0.905,
        "counterfactual": {
            "gpu_seconds_lost": 40.0,
            "gpu_hours_saved": 0.008472,
            "money_saved_minor": None,
        },
    }
    row = credit_row(RECORD, start, end, goodput)
    assert set(row) == set(COLUMNS)
    assert (row["x_GpuSecondsAllocated"], row["x_GpuSecondsProgress"]) == ("100.0", "90.5")
    assert (row["x_GpuSecondsLost"], row["x_Ettr"]) == ("9.5", "0.905")
    assert (row["x_CounterfactualGpuSecondsLost"], row["x_GpuHoursSaved"]) == ("40.0", "0.008472")
    assert row["x_MoneySavedMinor"] is None  # no price per GPU-hour


def test_csv_and_json_carry_the_same_rows() -> None:
    start, end = datetime(2026, 4, 1, tzinfo=UTC), datetime(2026, 5, 1, tzinfo=UTC)
    rows = [credit_row(RECORD, start, end)]
    ctype, body = render(rows, "csv")
    assert ctype.startswith("text/csv")
    parsed = list(csv.DictReader(io.StringIO(body)))
    assert parsed[0]["BilledCost"] == "-2500.01"
    assert parsed[0]["ChargeClass"] == ""
    jtype, jbody = render(rows, "json")
    assert jtype == "application/json"
    assert json.loads(jbody)[0]["BilledCost"] == "-2500.01"
    assert json.loads(jbody)[0]["ChargeClass"] is None
    # An empty period still has the header, so a loader sees the schema.
    assert render([], "csv")[1].splitlines()[0].split(",") == list(COLUMNS)
