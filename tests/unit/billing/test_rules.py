"""The guarantee's rules: what counts, the exact ratio test, the credit rounding."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from services.billing.rules import (
    ContractInvalid,
    ContractRequest,
    EntryClass,
    Tally,
    billing_period,
    classify,
    contract_id_for,
    covers,
    credit_minor,
    epoch_us,
    evaluate,
    from_epoch_us,
    meets,
)
from torchrelay.contract import Contract, FaultKind, Incident, Resolution, Severity

START = datetime(2026, 1, 1, tzinfo=UTC)
END = datetime(2026, 4, 1, tzinfo=UTC)


def incident(resolution: Resolution, kind: FaultKind = FaultKind.GPU_LOST) -> Incident:
    return Incident(
        incident_id="i1",
        tenant="acme",
        job_id="j1",
        node="n1",
        fault_kind=kind,
        severity=Severity.FATAL,
        detected_at=START,
        resolution=resolution,
    )


def contract(**kw: object) -> Contract:
    base: dict[str, object] = {
        "contract_id": "c1",
        "tenant": "acme",
        "term_start": START,
        "term_end": END,
        "renewal_fee_minor": 1_000_000,
        "currency": "USD",
    }
    base.update(kw)
    return Contract.model_validate(base)


@pytest.mark.parametrize(
    ("resolution", "kind", "expected"),
    [
        (Resolution.MIGRATED_LIVE, FaultKind.GPU_LOST, EntryClass.RESOLVED),
        (Resolution.MIGRATED_PROACTIVE, FaultKind.THERMAL_SLOWDOWN, EntryClass.PREVENTED),
        (Resolution.CHECKPOINT_RESTART, FaultKind.WORKER_LOST, EntryClass.UNRESOLVED),
        (Resolution.LOST, FaultKind.NVLINK_FATAL, EntryClass.UNRESOLVED),
        (Resolution.SHRUNK, FaultKind.GPU_LOST, EntryClass.UNRESOLVED),
        (Resolution.MANUAL, FaultKind.GPU_LOST, EntryClass.UNRESOLVED),
        (Resolution.OPEN, FaultKind.GPU_LOST, EntryClass.UNRESOLVED),
        (Resolution.EXCLUDED, FaultKind.GPU_LOST, EntryClass.EXCLUDED),
        # An application error is the customer's code: excluded whatever its resolution.
        (Resolution.MIGRATED_LIVE, FaultKind.APPLICATION_ERROR, EntryClass.EXCLUDED),
        (Resolution.LOST, FaultKind.APPLICATION_ERROR, EntryClass.EXCLUDED),
    ],
)
def test_classify(resolution: Resolution, kind: FaultKind, expected: EntryClass) -> None:
    assert classify(incident(resolution, kind)) == expected


def test_no_failures_meets_the_guarantee_with_ratio_one() -> None:
    g = evaluate(contract(), Tally(excluded=5), final=False)
    assert (g.eligible_failures, g.ratio, g.met, g.credit_minor, g.final) == (
        0,
        1.0,
        True,
        0,
        False,
    )


def test_exactly_ninety_percent_meets_and_just_under_does_not() -> None:
    assert evaluate(contract(), Tally(resolved=9, unresolved=1), final=True).met
    assert evaluate(contract(), Tally(resolved=27, unresolved=3), final=True).met
    under = evaluate(contract(), Tally(resolved=899, unresolved=101), final=True)
    assert not under.met
    assert under.credit_minor == 250_000
    # 0.9 is not exact in binary; the test is exact (9/10), so 0.9 * n boundaries hold.
    for n in range(1, 200):
        k = (9 * n + 9) // 10  # the smallest k with k/n >= 0.9
        assert meets(k, n, 0.9)
        assert not meets(k - 1, n, 0.9)


def test_application_errors_do_not_count() -> None:
    g = evaluate(contract(), Tally(resolved=9, unresolved=1, excluded=100), final=True)
    assert (g.eligible_failures, g.resolved_by_migration, g.met) == (10, 9, True)


def test_proactive_counts_only_when_the_contract_says_so() -> None:
    tally = Tally(resolved=8, unresolved=2, prevented=10)
    without = evaluate(contract(), tally, final=True)
    assert (without.eligible_failures, without.resolved_by_migration) == (10, 8)
    assert without.prevented_failures == 10
    assert not without.met
    with_ = evaluate(contract(count_proactive=True), tally, final=True)
    assert (with_.eligible_failures, with_.resolved_by_migration) == (20, 18)
    assert with_.met


def test_credit_rounds_half_up_to_minor_units() -> None:
    assert credit_minor(1_000_000, 0.25) == 250_000
    assert credit_minor(10, 0.25) == 3  # 2.5 -> 3
    assert credit_minor(6, 0.25) == 2  # 1.5 -> 2
    assert credit_minor(5, 0.25) == 1  # 1.25 -> 1
    assert credit_minor(7, 0.25) == 2  # 1.75 -> 2
    assert credit_minor(3, 0.5) == 2  # 1.5 -> 2
    assert credit_minor(1, 0.1) == 0  # 0.1 -> 0
    assert credit_minor(5, 0.1) == 1  # 0.5 exactly (0.1 read as 1/10) -> 1
    assert credit_minor(123, 0.0) == 0
    assert credit_minor(123, 1.0) == 123


@given(fee=st.integers(0, 10**15), rate_pct=st.integers(0, 100))
@settings(max_examples=100, deadline=None)
def test_credit_is_within_half_a_minor_unit(fee: int, rate_pct: int) -> None:
    credit = credit_minor(fee, rate_pct / 100)
    assert abs(credit * 100 - fee * rate_pct) <= 50
    assert 0 <= credit <= fee


def test_term_boundaries_are_half_open_in_utc() -> None:
    c = contract()
    assert covers(c, START)
    assert covers(c, END - timedelta(microseconds=1))
    assert not covers(c, END)
    assert not covers(c, START - timedelta(microseconds=1))
    # The same instant written in another zone is the same instant.
    assert covers(c, datetime.fromisoformat("2025-12-31T19:00:00-05:00"))


def test_epoch_us_round_trips() -> None:
    t = datetime(2026, 3, 31, 23, 59, 59, 999_999, tzinfo=UTC)
    assert from_epoch_us(epoch_us(t)) == t


def valid_request(**kw: object) -> dict[str, object]:
    body: dict[str, object] = {
        "tenant": "acme",
        "term_start": "2026-01-01T00:00:00Z",
        "term_end": "2026-04-01T00:00:00Z",
        "renewal_fee_minor": 100_000,
        "currency": "EUR",
    }
    body.update(kw)
    return body


def field_of(exc: ValidationError) -> str:
    return ".".join(str(p) for p in exc.errors()[0]["loc"])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"term_end": "2026-01-01T00:00:00Z"}, "term_end"),
        ({"term_end": "2025-12-01T00:00:00Z"}, "term_end"),
        ({"threshold": 0}, "threshold"),
        ({"threshold": 1.01}, "threshold"),
        ({"credit_rate": -0.1}, "credit_rate"),
        ({"credit_rate": 1.5}, "credit_rate"),
        ({"currency": "usd"}, "currency"),
        ({"currency": "ABC"}, "currency"),
        ({"currency": "XAU"}, "currency"),
        ({"renewal_fee_minor": -1}, "renewal_fee_minor"),
        ({"renewal_fee_minor": 10.5}, "renewal_fee_minor"),
        ({"renewal_fee_minor": "100"}, "renewal_fee_minor"),
        ({"term_start": "2026-01-01T00:00:00"}, "term_start"),
        ({"tenant": "a b"}, "tenant"),
    ],
)
def test_invalid_contracts_name_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        ContractRequest.model_validate(valid_request(**change))
    assert field_of(info.value) == field


def test_valid_contract_gets_a_deterministic_id() -> None:
    c = ContractRequest.model_validate(valid_request(threshold=1, credit_rate=0)).to_contract()
    assert c.contract_id == contract_id_for("acme", datetime(2026, 1, 1, tzinfo=UTC))
    assert (c.threshold, c.credit_rate, c.currency) == (1, 0, "EUR")
    jpy = ContractRequest.model_validate(valid_request(currency="JPY")).to_contract()
    assert jpy.currency == "JPY"


def test_billing_period() -> None:
    assert billing_period("2026-12") == (
        datetime(2026, 12, 1, tzinfo=UTC),
        datetime(2027, 1, 1, tzinfo=UTC),
    )
    for bad in ("2026-13", "2026-1", "26-01", "2026-01-01"):
        with pytest.raises(ContractInvalid) as info:
            billing_period(bad)
        assert info.value.field == "period"
