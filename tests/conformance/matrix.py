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
    # An LLM loop: 3 micro-batches from a DataLoader with workers on job.sampler, autocast
    # bf16, GradScaler, the global gradient clipped between job.reduce_gradients and the
    # optimizers' steps, two optimizers; the overlap's buckets small enough to be several.
    "llm": {
        "CF_BUILD": "after",
        "CF_THREADS": "1",
        "CF_OPTIMIZERS": "two",
        "CF_LOOP": "llm",
        "CF_ACCUM": "3",
        "CF_DATA": "loader",
        "TORCHRELAY_BUCKET_MB": "0.01",
    },
    # The same loop over a stream: a StatefulDataLoader whose position moves with the rank.
    "stream": {
        "CF_BUILD": "after",
        "CF_THREADS": "1",
        "CF_LOOP": "llm",
        "CF_ACCUM": "2",
        "CF_DATA": "stream",
        "TORCHRELAY_BUCKET_MB": "0.01",
    },
    # The LLM loop without the overlap: one flat all-reduce after backward.
    "flat": {
        "CF_BUILD": "before",
        "CF_THREADS": "1",
        "CF_LOOP": "llm",
        "CF_ACCUM": "2",
        "TORCHRELAY_OVERLAP": "0",
    },
    # A torch.compile'd model (inductor) in the LLM loop.
    "compiled": {
        "CF_BUILD": "after",
        "CF_THREADS": "1",
        "CF_LOOP": "llm",
        "CF_COMPILE": "inductor",
        "TORCHRELAY_BUCKET_MB": "0.01",
    },
}
LLM_SHAPES = {name for name, env in SHAPES.items() if env.get("CF_LOOP") == "llm"}

SCRIPT_POINTS = ("forward", "backward", "late_backward", "optimizer", "between")
LLM_POINTS = ("clip",)  # after the all-reduce, before the optimizers: the llm loop's
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


# make test's share of the matrix (its 20-minute budget): the fault-free runs under hogs
# and the forward-pass kills run with ``make conformance``.
REDUCED = [
    Cell("rich", "allreduce", "KILL", "idle"),
    Cell("plain", "between", "STOP", "idle"),
    Cell("plain", "send_state", "KILL", "hogs"),
    # The step API: buckets in flight at the kill, and a kill between the all-reduce and
    # the optimizers of a stream fed through a StatefulDataLoader.
    Cell("llm", "late_backward", "KILL", "hogs"),
    Cell("stream", "clip", "KILL", "idle"),
]


FAULT_FREE_REPEATS = 20


def full() -> list[Cell]:
    """Every shape x every fault point x both signals (script and agent points) x load, and
    issue 21's fault-free run under CPU hogs, 20 times."""
    cells = [Cell("issue21", "none", "-", "hogs", i) for i in range(FAULT_FREE_REPEATS)]
    for shape, load in itertools.product(SHAPES, ("idle", "hogs")):
        points = SCRIPT_POINTS + AGENT_POINTS + (LLM_POINTS if shape in LLM_SHAPES else ())
        for point, sig in itertools.product(points, ("KILL", "STOP")):
            cells.append(Cell(shape, point, sig, load))
        for point in TRANSFER_POINTS:
            cells.append(Cell(shape, point, "KILL", load))
        if SHAPES[shape].get("CF_BUILD") == "before":  # a warm-up needs the model first
            cells.append(Cell(shape, "warm_up", "KILL", load))
    return cells


def select(spec: str) -> list[Cell]:
    """The cells ``TORCHRELAY_CONFORMANCE`` names: "all", "shape:A,B" (every cell of those
    shapes), "kill:A,B" (their SIGKILL cells on an idle machine), else :data:`REDUCED`."""
    kind, _, names = spec.partition(":")
    shapes = set(names.split(",")) if names else set(SHAPES)
    unknown = shapes - set(SHAPES)
    if unknown:
        raise ValueError(f"TORCHRELAY_CONFORMANCE={spec!r}: no shape {sorted(unknown)}")
    if kind == "all":
        return full()
    if kind == "shape":
        return [c for c in full() if c.shape in shapes]
    if kind == "kill":
        return [
            c
            for c in full()
            if c.shape in shapes and c.signal == "KILL" and c.load == "idle" and c.repeat == 0
        ]
    return REDUCED


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
