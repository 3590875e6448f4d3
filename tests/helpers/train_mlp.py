"""A tiny torchrelay training script for tests and benchmarks: an MLP with dropout, AdamW
and an LR scheduler on a synthetic regression set.

Environment knobs (all optional):
  TR_STEPS         steps to train (default 30)
  TR_WIDTH         hidden width (default 32)
  TR_DEPTH         hidden layers (default 2)
  TR_STEP_SLEEP_S  a pause inside each step, between backward and job.step (default 0.02)
  TR_RAISE_AT      "RANK:STEP": that rank raises RuntimeError at that step (application error)
  TR_DIE_ON_JOIN   a member id that SIGKILLs itself right after init() (a spare dying while
                   it joins)
At the end each rank writes <TORCHRELAY_RUN_DIR>/<member_id>.digest.json with the sha256 of
its tracked state and the perf_counter time of each of its commits.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

torch.set_num_threads(1)

import torchrelay  # noqa: E402 - after the thread setting, like a user script would

job = torchrelay.init()
member = os.environ["TORCHRELAY_MEMBER_ID"]
if os.environ.get("TR_DIE_ON_JOIN") == member:
    os.kill(os.getpid(), signal.SIGKILL)

steps = int(os.environ.get("TR_STEPS", "30"))
width = int(os.environ.get("TR_WIDTH", "32"))
depth = int(os.environ.get("TR_DEPTH", "2"))
pause = float(os.environ.get("TR_STEP_SLEEP_S", "0.02"))
raise_at = os.environ.get("TR_RAISE_AT")

torch.manual_seed(1234)
layers: list[nn.Module] = [nn.Linear(16, width), nn.ReLU(), nn.Dropout(0.1)]
for _ in range(depth - 1):
    layers += [nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1)]
layers.append(nn.Linear(width, 1))
model = nn.Sequential(*layers)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
job.track(model=model, optimizer=optimizer, scheduler=scheduler)

gen = torch.Generator().manual_seed(99)
x = torch.randn(512, 16, generator=gen)
y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(512, 1, generator=gen)
data = TensorDataset(x, y)

commits: list[float] = []
for step, (xb, yb) in job.batches(data, batch_size=8, max_steps=steps, seed=7):
    if raise_at == f"{job.rank}:{step}":
        raise RuntimeError(f"user code failed at step {step}")
    loss = nn.functional.mse_loss(model(xb), yb)
    loss.backward()
    if pause:
        time.sleep(pause)
    if job.step(optimizer):
        scheduler.step()
        commits.append(time.perf_counter())
    optimizer.zero_grad()

digest = job.state_digest()
out = Path(os.environ["TORCHRELAY_RUN_DIR"]) / f"{member}.digest.json"
out.write_text(
    json.dumps(
        {
            "member_id": member,
            "rank": job.rank,
            "digest": digest,
            "committed_step": job.committed_step,
            "generation": job.generation,
            "commit_times": commits,
        }
    )
)
job.finish()
