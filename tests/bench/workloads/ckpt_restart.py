"""Checkpoint-restart arm: plain DDP-style data parallelism under ``torchrun --max-restarts``.

Rank 0 writes a checkpoint (model, optimizer, step) to local disk every ``--every`` steps;
when a rank dies torchrun stops every worker and starts them all again, and they resume from
the last checkpoint, as a torchrun job does.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tests.bench.workloads.common import StepLog, batch, build_model, build_optimizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--ckpt-dir", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torchrun keeps one store across restarts; without a per-attempt prefix the restarted
    # workers read the previous attempt's gloo addresses and fail to connect.
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timedelta(seconds=60),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"attempt{attempt}", store),  # type: ignore[attr-defined]
        rank=rank,
        world_size=world,
    )
    log = StepLog(rank)
    model = build_model()
    optimizer = build_optimizer(model)
    ckpt = Path(args.ckpt_dir) / "last.pt"
    start = 0
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = int(saved["step"]) + 1
    params = list(model.parameters())
    for step in range(start, args.steps):
        log.begin(step)
        x, y = batch(step, rank)
        out = model(x)
        log.maybe_die(step)
        nn.functional.cross_entropy(out, y).backward()  # type: ignore[no-untyped-call]
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
            offset += n
        optimizer.step()
        optimizer.zero_grad()
        log.commit(step)
        if (step + 1) % args.every == 0:
            if rank == 0:
                tmp = ckpt.with_suffix(".tmp")
                torch.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "step": step,
                    },
                    tmp,
                )
                os.replace(tmp, ckpt)
            dist.barrier()
    log.final({"model": model, "optimizer": optimizer}, args.steps - 1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
