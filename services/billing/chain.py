"""The ledger's hash chain: canonical JSON, entry hashes, and the verifier (pure functions).

Every entry of a contract's chain is a JSON object with a ``seq`` (1, 2, 3, ...), the
``prev_hash`` of the entry before it (64 zeros for the first) and its own ``hash``:

    hash = sha256(canonical_json(entry without "hash")).hexdigest()

where canonical JSON is UTF-8, keys sorted, no insignificant whitespace. Because
``prev_hash`` is inside what is hashed, rewriting any entry changes its hash and breaks the
link from the next one; rewriting the last entry changes the chain head, which the export
hands to the customer. The hashes are computed in Python (Redis' Lua has SHA-1 only); the
Lua append script checks atomically that the entry extends the current head.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

GENESIS = "0" * 64


def canonical_json(value: Any) -> str:
    """The canonical JSON text of ``value``: sorted keys, compact, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(value: Any) -> str:
    """The sha256 hex digest of ``value``'s canonical JSON."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def entry_hash(entry: dict[str, Any]) -> str:
    """The hash of a chain entry: sha256 of its canonical JSON without the ``hash`` field."""
    return digest({k: v for k, v in entry.items() if k != "hash"})


def seal(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` with its ``hash`` set."""
    body = {k: v for k, v in entry.items() if k != "hash"}
    return {**body, "hash": entry_hash(body)}


@dataclass(frozen=True)
class BadEntry:
    """The first entry of a chain that does not match, and why."""

    contract_id: str
    incident_id: str | None
    seq: int | None
    reason: str

    def as_dict(self) -> dict[str, Any]:
        """The JSON form of ``ledger_verify``'s ``first_bad``."""
        return {
            "contract_id": self.contract_id,
            "incident_id": self.incident_id,
            "seq": self.seq,
            "reason": self.reason,
        }


class ChainVerifier:
    """Checks one chain entry by entry; feed it the stored texts in order.

    Reports the first entry that does not match. When an entry is self-consistent but its
    successor's ``prev_hash`` points elsewhere, the entry itself was rewritten (with a
    recomputed hash), so it is the one named.
    """

    def __init__(self, chain_id: str) -> None:
        self.chain_id = chain_id
        self.checked = 0
        self.bad: BadEntry | None = None
        self._prev_hash = GENESIS
        self._prev_seq = 0
        self._prev_incident: str | None = None

    @property
    def head(self) -> tuple[int, str]:
        """``(seq, hash)`` of the last entry checked (``(0, GENESIS)`` when none)."""
        return self._prev_seq, self._prev_hash

    def feed(self, raw: str | bytes) -> dict[str, Any] | None:
        """Check the next stored entry: the parsed entry, or None once a bad one was found."""
        if self.bad is not None:
            return None
        expected_seq = self._prev_seq + 1
        try:
            entry = json.loads(raw)
            if not isinstance(entry, dict):
                raise TypeError("not a JSON object")
        except (ValueError, TypeError) as exc:
            self.bad = BadEntry(
                self.chain_id,
                None,
                expected_seq,
                f"entry at position {expected_seq} is not valid JSON: {exc}",
            )
            return None
        incident_id = entry.get("incident_id")
        seq = entry.get("seq")
        if seq != expected_seq:
            self.bad = BadEntry(
                self.chain_id,
                incident_id,
                expected_seq,
                f"entry at position {expected_seq} carries seq {seq!r}",
            )
            return None
        if entry.get("hash") != entry_hash(entry):
            self.bad = BadEntry(
                self.chain_id,
                incident_id,
                expected_seq,
                "entry content does not match its hash (the entry was altered)",
            )
            return None
        if entry.get("prev_hash") != self._prev_hash:
            self.bad = BadEntry(
                self.chain_id,
                self._prev_incident,
                self._prev_seq,
                f"entry {expected_seq} links to prev_hash {str(entry.get('prev_hash'))[:16]}… "
                f"but entry {self._prev_seq} hashes to {self._prev_hash[:16]}… "
                f"(entry {self._prev_seq} was rewritten with a new hash, or entry "
                f"{expected_seq}'s link was)",
            )
            return None
        self.checked += 1
        self._prev_seq = expected_seq
        self._prev_hash = str(entry["hash"])
        self._prev_incident = incident_id
        return entry

    def check_head(self, head_seq: int, head_hash: str) -> bool:
        """Compare the stored chain head with the last entry; False on a mismatch."""
        if self.bad is not None:
            return False
        if (head_seq, head_hash) != self.head:
            self.bad = BadEntry(
                self.chain_id,
                self._prev_incident,
                self._prev_seq,
                f"chain head says seq {head_seq} hash {head_hash[:16]}… but the last entry is "
                f"seq {self._prev_seq} hash {self._prev_hash[:16]}… (the last entry was "
                "rewritten or removed)",
            )
            return False
        return True


def verify_entries(chain_id: str, raws: Iterable[str | bytes]) -> ChainVerifier:
    """Run a :class:`ChainVerifier` over a whole chain's stored entries."""
    verifier = ChainVerifier(chain_id)
    for raw in raws:
        if verifier.feed(raw) is None:
            break
    return verifier
