"""The conformance matrix: script shapes x fault points x machine load.

Each cell runs tests/conformance/script.py under ``torchrelay run`` (the test executor plays
the control plane), injects its fault and compares every rank's final state bitwise with
the fault-free run of the same shape. ``make test`` runs :data:`REDUCED`; ``make
conformance`` (``TORCHRELAY_CONFORMANCE=all``) every cell of :func:`full`.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

SHAPES: dict[str, dict[str, str]] = {
    # README's order: model before init(), one thread, one optimizer, scheduler inside.
    "plain": {"CF_BUILD": "before", "CF_THREADS": "1", "CF_OPTIMIZERS": "one"},
    # Built after init(), torch's thread count, two optimizers over parameter groups, a
    # frozen layer and an unused parameter, the scheduler stepped whatever step() returned.
    "rich": {
        "CF_BUILD": "after",
        "CF_THREADS": "default",
        "CF_OPTIMIZERS": "two",
        "CF_FROZEN": "1",
        "CF_SCHED": "outside",
    },
    # No dropout, torch's thread count, built after init().
    "bare": {"CF_BUILD": "after", "CF_THREADS": "default", "CF_DROPOUT": "0"},
    # Issue 21's script: built after init(), torch's thread count, dropout, AdamW, StepLR
    # inside the commit check, a 50 ms pause after each step, 60 steps.
    "issue21": {
        "CF_BUILD": "after",
        "CF_THREADS": "default",
        "CF_OPTIMIZERS": "one",
        "CF_SLEEP_S": "0.05",
        "CF_STEPS": "60",
    },
    # Built before init() with every optional feature, scheduler inside.
    "mixed": {
        "CF_BUILD": "before",
        "CF_THREADS": "default",
        "CF_OPTIMIZERS": "two",
        "CF_FROZEN": "1",
    },
}

SCRIPT_POINTS = ("forward", "backward", "optimizer", "between")
AGENT_POINTS = ("allreduce",)
TRANSFER_POINTS = ("send_state", "recv_state")
FAULT_STEP = 4
HOGS = 4


@dataclass(frozen=True)
class Cell:
    shape: str
    fault: str  # "none", a point, or "warm_up"
    signal: str = "KILL"
    load: str = "idle"
    repeat: int = 0

    @property
    def id(self) -> str:
        return f"{self.shape}-{self.fault}-{self.signal}-{self.load}-{self.repeat}"


REDUCED = [
    Cell("issue21", "none", "-", "hogs"),
    Cell("rich", "forward", "KILL", "hogs"),
    Cell("rich", "allreduce", "KILL", "idle"),
    Cell("plain", "between", "STOP", "idle"),
    Cell("plain", "send_state", "KILL", "hogs"),
]


FAULT_FREE_REPEATS = 20


def full() -> list[Cell]:
    """Every shape x every fault point x both signals (script and agent points) x load, and
    issue 21's fault-free run under CPU hogs, 20 times."""
    cells = [Cell("issue21", "none", "-", "hogs", i) for i in range(FAULT_FREE_REPEATS)]
    for shape, load in itertools.product(SHAPES, ("idle", "hogs")):
        for point, sig in itertools.product(SCRIPT_POINTS + AGENT_POINTS, ("KILL", "STOP")):
            cells.append(Cell(shape, point, sig, load))
        for point in TRANSFER_POINTS:
            cells.append(Cell(shape, point, "KILL", load))
        if SHAPES[shape].get("CF_BUILD") == "before":  # a warm-up needs the model first
            cells.append(Cell(shape, "warm_up", "KILL", load))
    return cells


RESULTS: list[dict[str, Any]] = []


@contextmanager
def cpu_load(load: str) -> Iterator[None]:
    """``hogs``: busy-loop processes competing for the cores while the cell runs."""
    procs = []
    if load == "hogs":
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(HOGS)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
