"""Rank 0 of the poison test trains FSDP2 on with rank 1 killed or stopped mid-run: its
collectives must poison the generation, never raise into the loop (docs/design.md §12)."""

from __future__ import annotations

import datetime
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from torchrelay.agent._group import Backend, Wakeup
from torchrelay.agent._mesh import MESH_GROUPS


def main() -> None:
    rank, fault = int(os.environ["RANK"]), os.environ["POISON_FAULT"]
    stale_file = Path(os.environ["POISON_STALE_FILE"])
    store = TCPStore(
        "127.0.0.1",
        int(os.environ["MESH_PORT"]),
        2,
        rank == 0,
        timeout=datetime.timedelta(seconds=120),
    )
    backend = Backend("gloo", torch.device("cpu"), 120.0)
    MESH_GROUPS.init_default(rank, 2)
    MESH_GROUPS.watch(Wakeup(), stale_file.exists)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    MESH_GROUPS.rebind(1, PrefixStore("g1", store), backend.make_group, backend.device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        if step == 1 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        if step == 1:
            print("ready", flush=True)
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        print(f"step {step} poisoned {type(MESH_GROUPS.poisoned).__name__}", flush=True)
    # Once poisoned, a collective returns at once with zeros.
    probe = torch.ones(3)
    dist.all_reduce(probe)
    print(f"probe {probe.tolist()}", flush=True)


if __name__ == "__main__":
    main()
