"""A complete torchrelay training script: a 2.4M-parameter MLP classifier on generated data.

Used by ``torchrelay demo`` and the end-to-end tests. Run it under the launcher::

    torchrelay run --nproc 4 --spares 2 -m torchrelay.examples.train_mlp -- --steps 200

The data set is a fixed Gaussian-mixture classification problem generated from a seed, so
every process (and every spare) sees the same data without downloading anything. At the end
each rank writes the sha256 of its final model and optimizer state to ``--out`` so a run with
failures can be compared bitwise with a fault-free one.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

import torchrelay

FEATURES = 512
CLASSES = 16


def make_dataset(samples: int = 16_384, seed: int = 1234) -> torch.utils.data.TensorDataset:
    """A Gaussian-mixture classification data set, identical in every process."""
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, FEATURES, generator=gen) * 2.0
    labels = torch.randint(0, CLASSES, (samples,), generator=gen)
    x = centers[labels] + torch.randn(samples, FEATURES, generator=gen)
    return torch.utils.data.TensorDataset(x, labels)


def build_model(hidden: int = 1536, seed: int = 7) -> nn.Module:
    """The MLP (~2.4M parameters with the default width), with dropout."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, hidden),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(hidden, 1024),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(1024, CLASSES),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--out", default=None, help="directory for the final state digests")
    parser.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        help="extra seconds per step (to watch a demo live)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    # Build the model and optimizer first: a hot spare blocks in init() until it takes a
    # rank, and whatever it built before is ready then instead of on the survivors' stall.
    model = build_model(args.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
    job = torchrelay.init()
    job.track(model=model, optimizer=optimizer, scheduler=scheduler)
    loss_fn = nn.CrossEntropyLoss()
    dataset = make_dataset()
    loss = torch.tensor(0.0)
    for _step, (x, y) in job.batches(dataset, batch_size=args.batch_size, max_steps=args.steps):
        loss = loss_fn(model(x), y)
        loss.backward()
        if job.step(optimizer):
            scheduler.step()
        optimizer.zero_grad()
        if args.step_sleep:
            time.sleep(args.step_sleep)
    job.finish()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "rank": job.rank,
            "member": os.environ.get("TORCHRELAY_MEMBER_ID"),
            "step": job.committed_step,
            "generation": job.generation,
            "loss": loss.item(),
            "sha256": job.state_digest(),
        }
        (out / f"rank{job.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
