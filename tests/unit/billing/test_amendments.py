"""The amendment rules alone: what an amendment may change, and what the verifier refuses."""

from __future__ import annotations

from typing import Any

import pytest

from services.billing.amendments import AmendmentRefused, amended_fields, amendment_problem

CLOSED = {"incident_id": "r1", "resolution": "checkpoint_restart", "node": "n1", "lost_steps": None}


def amendment(**incident: Any) -> dict[str, Any]:
    body = {**CLOSED, **incident}
    return {
        "kind": "amendment",
        "class": "unresolved",
        "amends_seq": 4,
        "fields": amended_fields(CLOSED, body),
        "incident": body,
    }


def test_an_amendment_may_change_lost_steps_and_stall_only() -> None:
    assert amended_fields(CLOSED, {**CLOSED, "lost_steps": 3, "stall_ms": 9.5}) == [
        "lost_steps",
        "stall_ms",
    ]
    with pytest.raises(AmendmentRefused, match="changes node, resolution too"):
        amended_fields(CLOSED, {**CLOSED, "node": "n2", "resolution": "migrated_live"})


def test_the_verifier_checks_an_amendment_against_the_entry_before_it() -> None:
    prior = (4, "unresolved", CLOSED)
    good = amendment(lost_steps=3)
    assert amendment_problem(good, prior) is None
    assert "no entry before it" in str(amendment_problem(good, None))
    assert "follows entry 4, not 5" in str(amendment_problem(good, (5, "unresolved", CLOSED)))
    assert "class from resolved" in str(amendment_problem(good, (4, "resolved", CLOSED)))
    lying = {**good, "fields": ["stall_ms"]}
    assert "lists fields ['stall_ms'] but changes ['lost_steps']" in str(
        amendment_problem(lying, prior)
    )
    moved = {**good, "incident": {**CLOSED, "node": "n2"}}
    assert "may change only" in str(amendment_problem(moved, prior))
