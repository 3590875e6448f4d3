"""What every arm of the migration bench trains, and how its ranks report their steps.

One model (an MLP of ~2.4M parameters), one optimizer (AdamW), step-indexed data: the batch of
(step, rank) is a pure function of the two, so a rank that redoes a step redoes it exactly.
Every process appends ``begin <step> <t>`` / ``commit <step> <t>`` lines to
``$BENCH_LOG_DIR/rank<r>.log`` (one file per rank across restarts and replacements), and the
rank named by ``BENCH_KILL_RANK`` SIGKILLs itself at step ``BENCH_KILL_STEP`` after the
forward pass, once per run (a marker file in the log dir says it has happened).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

FEATURES = 512
HIDDEN = 1536
CLASSES = 16
BATCH = 32
SEED = 1234


def build_model() -> nn.Module:
    """The MLP, identically initialised in every process (2,378,256 parameters)."""
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, 1024),
        nn.ReLU(),
        nn.Linear(1024, CLASSES),
    )


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with a fixed learning rate."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch rank ``rank`` trains on at step ``step``: a fixed Gaussian mixture."""
    centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(SEED)) * 2
    gen = torch.Generator().manual_seed(SEED * 1_000_003 + step * 1_009 + rank)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    x = centers[labels] + torch.randn(BATCH, FEATURES, generator=gen)
    return x, labels


def state_sha256(tracked: Mapping[str, Any]) -> str:
    """sha256 over the exact bits of every tracked object's state dict, in a fixed order."""
    h = hashlib.sha256()

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(value, Mapping):
            for key in sorted(value, key=repr):
                h.update(repr(key).encode())
                feed(value[key])
        elif isinstance(value, list | tuple):
            for item in value:
                feed(item)
        else:
            h.update(repr(value).encode())

    for name in sorted(tracked):
        h.update(name.encode())
        feed(tracked[name].state_dict())
    return h.hexdigest()


class StepLog:
    """Appends this rank's step begins and commits to the shared log directory."""

    def __init__(self, rank: int) -> None:
        self.dir = Path(os.environ["BENCH_LOG_DIR"])
        self.rank = rank
        self._file = (self.dir / f"rank{rank}.log").open("a", buffering=1)
        self.kill_rank = int(os.environ.get("BENCH_KILL_RANK", "-1"))
        self.kill_step = int(os.environ.get("BENCH_KILL_STEP", "-1"))

    def begin(self, step: int) -> None:
        self._file.write(f"begin {step} {time.time():.6f}\n")

    def commit(self, step: int) -> None:
        self._file.write(f"commit {step} {time.time():.6f}\n")

    def maybe_die(self, step: int) -> None:
        """SIGKILL this process if it is the victim at the kill step (once per run)."""
        if self.rank != self.kill_rank or step != self.kill_step:
            return
        try:
            fd = os.open(self.dir / "killed", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, f"{os.getpid()} {time.time():.6f}\n".encode())
        os.close(fd)
        self._file.write(f"killed {step} {time.time():.6f}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    def final(self, tracked: Mapping[str, Any], step: int, **extra: Any) -> None:
        """Write this rank's final state digest."""
        record = {"rank": self.rank, "step": step, "sha256": state_sha256(tracked), **extra}
        (self.dir / f"final{self.rank}.json").write_text(json.dumps(record))
