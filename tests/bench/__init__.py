"""Benchmarks: `python -m tests.bench [names...]` (run by `make bench`, not by `make test`)."""

from __future__ import annotations

from typing import Any


def print_figures(title: str, figures: dict[str, Any]) -> None:
    """A benchmark's figures as the two-column table every module prints."""
    width = max(len(k) for k in figures)
    print(title)
    for key, value in figures.items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"  {key:<{width}}  {shown}")
