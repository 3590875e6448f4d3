"""One rank of the mesh test: FSDP2, HSDP and tensor parallelism over stock gloo groups
(``MESH_MODE=stock``) or over torchrelay's rebound groups (``MESH_MODE=relay``), printing
a sha256 of each model's local shards and optimizer state after training."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from torchrelay.agent._group import Backend
from torchrelay.agent._mesh import MESH_GROUPS
from torchrelay.agent._state import local_view, state_digest

STEPS = 6
REBIND_AT = 3


def build() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.ReLU()
    )


def train(name: str, mesh: Any, rank: int, rebind: Any) -> str:
    model = build()
    if name == "tp":
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        dp = mesh["dp"].get_group()
    else:
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        if step == REBIND_AT:
            rebind(f"{name}-{step}")
        torch.manual_seed(1000 * step + rank)
        loss = model(torch.randn(4, 16)).pow(2).mean()
        loss.backward()
        if name == "tp":  # data parallel over the replicas: the mean of the local grads
            for p in model.parameters():
                g = local_view(p.grad)
                dist.all_reduce(g, group=dp)
                g.div_(mesh["dp"].size())
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return state_digest({"model": model, "optimizer": opt})


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=60)
    store = TCPStore("127.0.0.1", int(os.environ["MESH_PORT"]), world, rank == 0, timeout=timeout)
    relay = os.environ["MESH_MODE"] == "relay"
    backend = Backend("gloo", torch.device("cpu"), 60.0)

    def rebind(generation: str) -> None:
        if relay:
            MESH_GROUPS.rebind(
                1, PrefixStore(generation, store), backend.make_group, backend.device
            )

    if relay:
        MESH_GROUPS.init_default(rank, world)
    else:
        dist.init_process_group(
            "gloo", store=PrefixStore("stock", store), rank=rank, world_size=world
        )
    half = (2, world // 2)
    meshes = {
        "fsdp": init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)),
        "hsdp": init_device_mesh("cpu", half, mesh_dim_names=("replicate", "shard")),
        "tp": init_device_mesh("cpu", half, mesh_dim_names=("dp", "tp")),
    }
    rebind("first")
    for name, mesh in meshes.items():
        print(f"digest {name} {rank} {train(name, mesh, rank, rebind)}", flush=True)


if __name__ == "__main__":
    main()
