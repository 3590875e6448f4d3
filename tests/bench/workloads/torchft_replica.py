"""torchft arm: one replica group of one rank, as torchft's own ``train_ddp.py`` sets it up on CPU.

A Gloo process group (5 s timeout), torchft's ``Optimizer`` wrapper around the same MLP and
AdamW, the gradients all-reduced through ``Manager.allreduce`` and waited for (what torchft's DDP
comm hook does: on this torch, torchft 0.2.0's ``DistributedDataParallel`` dies with an
``AssertionError`` in that hook when a peer's all-reduce fails, and with
``PureDistributedDataParallel``, whose hooks do not wait for their all-reduces, the replicas'
final states differed from each other after the fault in our run), a ``Manager`` with
``min_replica_size=1`` that asks the lighthouse (``TORCHFT_LIGHTHOUSE``) for a quorum every
step and heals a restarted replica from a peer. The quorum is synchronous so the step index
(and so the batch) is known before the forward pass.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp
from torchft import Manager, Optimizer, ProcessGroupGloo  # type: ignore[import-untyped,unused-ignore]

from tests.bench.workloads.common import StepLog, batch, build_model, build_optimizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--replicas", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    replica = int(os.environ["BENCH_REPLICA"])
    log = StepLog(replica)
    model = build_model()
    inner = build_optimizer(model)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False
    )
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench_{replica}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=30),
        use_async_quorum=False,
    )
    params = list(model.parameters())
    optimizer = Optimizer(manager, inner)
    if not os.environ.get("BENCH_RESTARTED"):
        # Start together, as a job's replicas do: a quorum formed before every replica's
        # manager heartbeats would start with fewer replicas and make the runs incomparable.
        ready = Path(os.environ["BENCH_LOG_DIR"])
        (ready / f"ready{replica}").touch()
        deadline = time.monotonic() + 120
        while len(list(ready.glob("ready*"))) < args.replicas:
            if time.monotonic() > deadline:
                raise RuntimeError("the other torchft replicas did not start within 120 s")
            time.sleep(0.05)
        time.sleep(0.5)  # two heartbeat intervals: every manager is known to the lighthouse
    while manager.current_step() < args.steps:
        optimizer.zero_grad()  # runs the quorum (and the heal of a restarted replica)
        step = manager.current_step()
        if step >= args.steps:
            break
        log.begin(step)
        x, y = batch(step, replica)
        out = model(x)
        log.maybe_die(step)
        nn.functional.cross_entropy(out, y).backward()  # type: ignore[no-untyped-call]
        # One fault-tolerant all-reduce of the flattened gradients, waited for, as torchft's
        # DDP comm hook does; an error marks the step so that should_commit() refuses it.
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        flat /= max(1, manager.num_participants())
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))  # type: ignore[union-attr]
            offset += p.numel()
        optimizer.step()  # commits only if every participant's all-reduce succeeded
        if manager.current_step() > step:
            log.commit(step)
    log.final({"model": model, "optimizer": inner}, manager.current_step() - 1)
    # torchft 0.2.0 on this torch aborts in a thread destructor at interpreter exit
    # ("terminate called without an active exception"); the run's work is done and written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
