"""Billing: the failure ledger, the guarantee, credits and the FOCUS export (docs/design.md §8)."""

from .ledger import AppendResult, CloseResult, Ledger
from .rules import EntryClass, Tally, classify, credit_minor, evaluate, meets

__all__ = [
    "AppendResult",
    "CloseResult",
    "EntryClass",
    "Ledger",
    "Tally",
    "classify",
    "credit_minor",
    "evaluate",
    "meets",
]
