"""The plain loop of the agent benchmark: the same model, data and gloo all-reduce as
tests/helpers/train_mlp.py, with no torchrelay agent (a process group built directly).

Usage: python _agent_plain.py RANK WORLD STORE_PORT OUT_JSON  (env TR_STEPS, TR_WIDTH, TR_DEPTH)
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

torch.set_num_threads(1)

from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore  # noqa: E402

from torchrelay.agent._data import StepSampler, make_batch  # noqa: E402

rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
steps = int(os.environ.get("TR_STEPS", "30"))
width = int(os.environ.get("TR_WIDTH", "32"))
depth = int(os.environ.get("TR_DEPTH", "2"))

timeout = datetime.timedelta(seconds=120)
store = TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=timeout)
opts = ProcessGroupGloo._Options()
opts._timeout = timeout
opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
pg = ProcessGroupGloo(PrefixStore("plain", store), rank, world, opts)

torch.manual_seed(1234)
layers: list[nn.Module] = [nn.Linear(16, width), nn.ReLU(), nn.Dropout(0.1)]
for _ in range(depth - 1):
    layers += [nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1)]
layers.append(nn.Linear(width, 1))
model = nn.Sequential(*layers)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
params = list(model.parameters())

gen = torch.Generator().manual_seed(99)
x = torch.randn(512, 16, generator=gen)
y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(512, 1, generator=gen)
data = TensorDataset(x, y)
sampler = StepSampler(len(data), 8, world, seed=7)

commits: list[float] = []
for step in range(steps):
    xb, yb = make_batch(data, sampler.indices(step, rank), None)
    loss = nn.functional.mse_loss(model(xb), yb)
    loss.backward()
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
    pg.allreduce([flat]).wait()
    flat.div_(world)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))  # type: ignore[union-attr]
        offset += p.numel()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    commits.append(time.perf_counter())
pg.barrier().wait()
with open(out, "w") as f:
    json.dump({"rank": rank, "commit_times": commits}, f)
