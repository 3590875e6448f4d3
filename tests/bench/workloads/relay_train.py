"""torchrelay arm: the bench's MLP under ``torchrelay run`` (the in-job agent does the all-reduce).

Run as a file by the launcher; ``PYTHONPATH`` must hold the repository root.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import torchrelay
from tests.bench.workloads.common import StepLog, batch, build_model, build_optimizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Built before init(), as README recommends: a hot spare blocks in init() until it takes a
    # rank, so whatever it builds before is ready, and off the survivors' stall, when it does.
    model = build_model()
    optimizer = build_optimizer(model)

    def warm_up() -> None:
        # Run by a hot spare before it waits: its first forward, backward and optimizer step
        # (cold: allocations, first-call paths) are then not on the survivors' stall. The
        # state it changes is replaced by a survivor's when the spare takes a rank.
        x, y = batch(0, 0)
        nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()

    job = torchrelay.init(warm_up=warm_up)  # a spare blocks here until it takes a rank
    job.track(model=model, optimizer=optimizer)
    log: StepLog | None = None
    # job.batches drives the step index; the data itself is the bench's step-indexed batch
    for step, _ in job.batches(list(range(1024)), batch_size=1, max_steps=args.steps):
        if log is None:  # the rank is known once the job's generation is entered
            log = StepLog(job.rank)
        log.begin(step)
        x, y = batch(step, job.rank)
        out = model(x)
        log.maybe_die(step)
        nn.functional.cross_entropy(out, y).backward()  # type: ignore[no-untyped-call]
        if job.step(optimizer):
            log.commit(step)
        optimizer.zero_grad()
    job.finish()
    if log is None:
        log = StepLog(job.rank)
    log.final({"model": model, "optimizer": optimizer}, job.committed_step)


if __name__ == "__main__":
    main()
