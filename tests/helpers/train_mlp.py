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
  TR_WARM_UP       a member id whose warm_up (a spare's, see torchrelay.init) trains a step
                   on its own and leaves the gradients behind, then writes
                   <TORCHRELAY_RUN_DIR>/<member_id>.warmed
  TR_WARM_UP_RAISE a member id whose warm_up raises
  TR_SEED_BY_MEMBER "1": each member seeds its model with 1234 + its member number (w2 -> 1236),
                   as a script that forgot to seed alike would; DDP's start makes them equal
  TR_WIDTH_OF      "MEMBER:WIDTH": that member builds a model of another width (a mismatch)
  TR_PERTURB       "MEMBER:STEP": that member adds 1e-3 to its first weight after committing
                   STEP, behind the agent's back (what the divergence guard must catch)
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

steps = int(os.environ.get("TR_STEPS", "30"))
width = int(os.environ.get("TR_WIDTH", "32"))
depth = int(os.environ.get("TR_DEPTH", "2"))
pause = float(os.environ.get("TR_STEP_SLEEP_S", "0.02"))
raise_at = os.environ.get("TR_RAISE_AT")
member = os.environ["TORCHRELAY_MEMBER_ID"]
run_dir = Path(os.environ["TORCHRELAY_RUN_DIR"])

if os.environ.get("TR_WIDTH_OF", "").rpartition(":")[0] == member:
    width = int(os.environ["TR_WIDTH_OF"].rpartition(":")[2])
perturb = os.environ.get("TR_PERTURB", "")
number = int("".join(ch for ch in member.rpartition("-")[2] if ch.isdigit()) or "0")

# Built before init(), as README recommends: a hot spare has them ready when it takes a rank.
torch.manual_seed(1234 + (number if os.environ.get("TR_SEED_BY_MEMBER") == "1" else 0))
layers: list[nn.Module] = [nn.Linear(16, width), nn.ReLU(), nn.Dropout(0.1)]
for _ in range(depth - 1):
    layers += [nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1)]
layers.append(nn.Linear(width, 1))
model = nn.Sequential(*layers)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)


def warm_up() -> None:
    if os.environ.get("TR_WARM_UP_RAISE") == member:
        raise RuntimeError("warm-up data is missing")
    if os.environ.get("TR_WARM_UP") != member:
        return
    # A step on made-up data that changes the model, the optimizer and the scheduler and,
    # on purpose, leaves its gradients: the agent must drop them when the state arrives.
    for _ in range(2):
        nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1)).backward()
        optimizer.step()
        scheduler.step()
    nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1)).backward()
    (run_dir / f"{member}.warmed").write_text("1")


job = torchrelay.init(warm_up=warm_up)
if os.environ.get("TR_DIE_ON_JOIN") == member:
    os.kill(os.getpid(), signal.SIGKILL)

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
        if perturb == f"{member}:{step}":
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)
    optimizer.zero_grad()

digest = job.state_digest()
out = run_dir / f"{member}.digest.json"
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
