"""Amendments: what a closed incident learns later, appended to its chain (pure rules).

A ``checkpoint_restart`` closes before the restart is known: its lost steps arrive with the
launcher's ``JobRestarted`` and its stall with the restarted job's first step. The ledger
never rewrites an entry, so each of these is a new ``amendment`` entry of the same chain:

    {"kind": "amendment", "incident_id", "class", "amends_seq", "fields", "incident",
     "digest", "recorded_at", "seq", "prev_hash", "hash"}

``amends_seq`` is the seq of the incident's entry it follows (the incident entry, or an
earlier amendment or correction), ``fields`` the incident fields it changes, ``incident``
the whole incident as now known. An amendment may change only ``AMENDABLE`` fields and never
how the incident counts (its class): anything else is a correction, the operator's.
"""

from __future__ import annotations

from typing import Any

AMENDABLE = frozenset({"stall_ms", "lost_steps"})


class AmendmentRefused(ValueError):
    """The amendment changes more than what a restart learns, or how the incident counts."""


def amended_fields(prior: dict[str, Any], amended: dict[str, Any]) -> list[str]:
    """The fields ``amended`` changes in ``prior`` (incident JSON), sorted.

    Raises:
        AmendmentRefused: a changed field is not one an amendment may change.
    """
    changed = sorted(k for k in prior.keys() | amended.keys() if prior.get(k) != amended.get(k))
    others = [k for k in changed if k not in AMENDABLE]
    if others:
        raise AmendmentRefused(
            f"an amendment may change only {', '.join(sorted(AMENDABLE))}; this one changes "
            f"{', '.join(others)} too (append a correction with ledger_correct instead)"
        )
    return changed


def amendment_problem(
    entry: dict[str, Any], prior: tuple[int, str, dict[str, Any]] | None
) -> str | None:
    """Why a stored amendment entry does not follow its incident's entry, or None.

    Args:
        entry: the amendment entry.
        prior: ``(seq, class, incident)`` of the incident's entry before it in the chain.
    """
    if prior is None:
        return "amendment of an incident that has no entry before it in the chain"
    seq, entry_class, incident = prior
    if entry.get("amends_seq") != seq:
        return f"amendment says it follows entry {entry.get('amends_seq')}, not {seq}"
    if entry.get("class") != entry_class:
        return f"amendment changes the class from {entry_class} to {entry.get('class')}"
    try:
        changed = amended_fields(incident, dict(entry.get("incident") or {}))
    except AmendmentRefused as exc:
        return str(exc)
    if changed != sorted(entry.get("fields") or []):
        return f"amendment lists fields {entry.get('fields')} but changes {changed}"
    return None
