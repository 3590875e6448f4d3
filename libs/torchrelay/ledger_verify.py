"""Client side of ``torchrelay ledger verify``: turn billing's verify report into words.

The billing service recomputes the hash chain (RPC ``tr.rpc.billing.ledger_verify``, or the
API route in front of it) and answers ``{ok, checked, chains, first_bad?}``. The command line
prints one line and exits 0 when the ledger verifies, 1 naming the first bad entry.
"""

from __future__ import annotations

from typing import Any

EXIT_VERIFIED = 0
EXIT_TAMPERED = 1


def describe_verify(report: dict[str, Any]) -> tuple[int, str]:
    """The exit code and the message for a ``ledger_verify`` report.

    Args:
        report: the verify result: ``ok``, ``checked``, ``chains`` and, when not ok,
            ``first_bad`` = ``{contract_id, incident_id, seq, reason}``.

    Returns:
        ``(0, "ledger verified: ...")`` or ``(1, "ledger entry does not match: ...")``.
    """
    checked = int(report.get("checked", 0))
    chains = report.get("chains")
    scope = f" in {chains} chain{'s' if chains != 1 else ''}" if chains is not None else ""
    if report.get("ok"):
        return EXIT_VERIFIED, f"ledger verified: {checked} entries{scope}, every hash matches"
    bad = report.get("first_bad") or {}
    where = [f"contract {bad.get('contract_id')}"]
    if bad.get("seq") is not None:
        where.append(f"entry {bad['seq']}")
    if bad.get("incident_id"):
        where.append(f"incident {bad['incident_id']}")
    return EXIT_TAMPERED, (
        f"ledger entry does not match: {', '.join(where)}: {bad.get('reason', 'unknown')} "
        f"({checked} entries before it verified)"
    )
