"""The overhead half of the agent benchmark, run under ``torchrelay run``.

Each rank alternates blocks of plain steps (its own gloo group built directly, the same
flatten / all-reduce / divide / optimizer step) with blocks of agent steps (``job.batches`` /
``job.step``), so both see the same machine load. Writes, per rank, the step gaps of each
kind to ``<TORCHRELAY_RUN_DIR>/<member_id>.mixed.json``.

Env: TR_WIDTH, TR_DEPTH, TR_BLOCKS, TR_BLOCK_STEPS, TR_PLAIN_PORT.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

torch.set_num_threads(1)

from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore  # noqa: E402

import torchrelay  # noqa: E402
from torchrelay.agent._data import StepSampler, make_batch  # noqa: E402

job = torchrelay.init()
rank, world = job.rank, job.world_size
width = int(os.environ.get("TR_WIDTH", "1024"))
depth = int(os.environ.get("TR_DEPTH", "3"))
blocks = int(os.environ.get("TR_BLOCKS", "4"))
per_block = int(os.environ.get("TR_BLOCK_STEPS", "12"))

timeout = datetime.timedelta(seconds=300)
store = TCPStore(
    "127.0.0.1",
    int(os.environ["TR_PLAIN_PORT"]),
    is_master=rank == 0,
    wait_for_workers=False,
    timeout=timeout,
)
opts = ProcessGroupGloo._Options()
opts._timeout = timeout
opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
plain_pg = ProcessGroupGloo(PrefixStore("plain", store), rank, world, opts)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1234)
    layers: list[nn.Module] = [nn.Linear(16, width), nn.ReLU(), nn.Dropout(0.1)]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1)]
    layers.append(nn.Linear(width, 1))
    model = nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


gen = torch.Generator().manual_seed(99)
x = torch.randn(512, 16, generator=gen)
y = x.sum(dim=1, keepdim=True)
data = TensorDataset(x, y)
sampler = StepSampler(len(data), 8, world, seed=7)

plain_model, plain_opt = build()
agent_model, agent_opt = build()
job.track(model=agent_model, optimizer=agent_opt)
params = list(plain_model.parameters())

plain_gaps: list[float] = []
agent_gaps: list[float] = []
plain_step = 0


def plain_block() -> None:
    global plain_step
    last = None
    for _ in range(per_block):
        xb, yb = make_batch(data, sampler.indices(plain_step, rank), None)
        nn.functional.mse_loss(plain_model(xb), yb).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        plain_pg.allreduce([flat]).wait()
        flat.div_(world)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))  # type: ignore[union-attr]
            offset += p.numel()
        plain_opt.step()
        plain_opt.zero_grad()
        plain_step += 1
        now = time.perf_counter()
        if last is not None:
            plain_gaps.append(now - last)
        last = now


def agent_block() -> None:
    last = None
    target = job.committed_step + 1 + per_block
    for _step, (xb, yb) in job.batches(data, batch_size=8, max_steps=target, seed=7):
        nn.functional.mse_loss(agent_model(xb), yb).backward()
        job.step(agent_opt)
        agent_opt.zero_grad()
        now = time.perf_counter()
        if last is not None:
            agent_gaps.append(now - last)
        last = now


# Alternate which kind goes first, so neither always follows the other.
for block in range(blocks):
    first, second = (plain_block, agent_block) if block % 2 == 0 else (agent_block, plain_block)
    first()
    second()

plain_pg.barrier().wait()
out = Path(os.environ["TORCHRELAY_RUN_DIR"]) / f"{os.environ['TORCHRELAY_MEMBER_ID']}.mixed.json"
out.write_text(json.dumps({"rank": rank, "plain": plain_gaps, "agent": agent_gaps}))
job.finish()
