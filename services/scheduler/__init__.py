"""The scheduler: turns faults into incidents and migration decisions (DESIGN.md §3)."""

from .rules import Decision, decide

__all__ = ["Decision", "decide"]
