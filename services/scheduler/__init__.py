"""The scheduler: turns faults into incidents and migration decisions (docs/design.md §3)."""

from .rules import Decision, decide

__all__ = ["Decision", "decide"]
