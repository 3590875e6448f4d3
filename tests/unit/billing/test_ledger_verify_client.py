"""The CLI helper words a verify report and picks the exit code."""

from __future__ import annotations

from torchrelay.ledger_verify import describe_verify


def test_a_verified_ledger_exits_zero() -> None:
    code, text = describe_verify({"ok": True, "checked": 12, "chains": 3})
    assert code == 0
    assert "12 entries in 3 chains" in text


def test_a_tampered_ledger_exits_one_naming_the_entry() -> None:
    code, text = describe_verify(
        {
            "ok": False,
            "checked": 2,
            "chains": 1,
            "first_bad": {
                "contract_id": "ct-1",
                "incident_id": "inc-7",
                "seq": 3,
                "reason": "entry content does not match its hash",
            },
        }
    )
    assert code == 1
    assert "contract ct-1, entry 3, incident inc-7" in text
    assert "does not match its hash" in text
