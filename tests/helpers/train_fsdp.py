"""A sharded training script on torchrelay's documented API (run under ``torchrelay run``).

FSDP2 over ``job.device_mesh``: ``TR_MESH=fsdp`` (1-D, every rank its own shard) or
``hsdp`` (2 replicas of world/2 shards). ``TR_STEPS`` steps of AdamW with the global gradient
clipped. At the end each rank writes <TORCHRELAY_RUN_DIR>/<member_id>.digest.json with the
sha256 of its tracked state (its shards).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

torch.set_num_threads(1)

import torchrelay  # noqa: E402 - after the thread setting, like a user script would

steps = int(os.environ.get("TR_STEPS", "12"))
run_dir = Path(os.environ["TORCHRELAY_RUN_DIR"])
member = os.environ["TORCHRELAY_MEMBER_ID"]

job = torchrelay.init()
if os.environ.get("TR_MESH", "fsdp") == "fsdp":
    mesh = job.device_mesh(job.world_size, mesh_dim_names=("shard",))
else:
    mesh = job.device_mesh((2, job.world_size // 2), mesh_dim_names=("replicate", "shard"))
torch.manual_seed(1234)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
job.track(model=model, optimizer=optimizer)

g = torch.Generator().manual_seed(7)
data = TensorDataset(torch.randn(512, 16, generator=g), torch.randn(512, 1, generator=g))
for _step, (x, y) in job.batches(data, batch_size=8, max_steps=steps):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    if job.reduce_gradients(optimizer):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    optimizer.zero_grad()

digest = job.state_digest()
(run_dir / f"{member}.digest.json").write_text(
    json.dumps(
        {"member_id": member, "rank": job.rank, "digest": digest, "step": job.committed_step}
    )
)
job.finish()
