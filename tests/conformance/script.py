"""A training script of the conformance matrix, written against the documented API only.

Its shape comes from the environment, so one file covers the shapes users write:
  CF_BUILD       "before" (model and optimizers before torchrelay.init()) or "after"
  CF_THREADS     "default" (torch's own thread count) or a number
  CF_DROPOUT     dropout probability (0 for none)
  CF_OPTIMIZERS  "one" (AdamW) or "two" (AdamW over two parameter groups of the body with
                 their own lr and weight decay, SGD with momentum over the head)
  CF_FROZEN      "1": a frozen layer (requires_grad False) and a parameter the forward never
                 uses (requires_grad True, no gradient)
  CF_SCHED       "inside" (scheduler stepped when job.step() returns True) or "outside"
                 (stepped after every job.step(), whatever it returned)
  CF_WIDTH, CF_STEPS, CF_SLEEP_S   hidden width, steps, pause after each step
  CF_FAULT       "POINT:MEMBER:STEP:SIGNAL": MEMBER sends itself SIGNAL (KILL or STOP) at
                 POINT of STEP, POINT one of forward, backward, optimizer, between
  CF_WARM_UP_S   a spare's warm_up trains a step and then takes this long
At the end each rank writes <TORCHRELAY_RUN_DIR>/<member>.digest.json (rank, digest).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchrelay

env = os.environ.get
member = os.environ["TORCHRELAY_MEMBER_ID"]
if env("CF_THREADS", "default") != "default":
    torch.set_num_threads(int(env("CF_THREADS", "1")))
width = int(env("CF_WIDTH", "64"))
steps = int(env("CF_STEPS", "16"))
pause = float(env("CF_SLEEP_S", "0.02"))
fault = env("CF_FAULT", "").split(":")
fault_point, fault_member = (fault[0], fault[1]) if len(fault) == 4 else ("", "")
fault_step = int(fault[2]) if len(fault) == 4 else -1
fault_signal = signal.SIGSTOP if fault[-1] == "STOP" else signal.SIGKILL


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        p = float(env("CF_DROPOUT", "0.1"))
        self.body = nn.Sequential(
            nn.Linear(16, width), nn.ReLU(), nn.Dropout(p), nn.Linear(width, width), nn.ReLU()
        )
        self.frozen = env("CF_FROZEN") == "1"
        if self.frozen:
            self.fixed = nn.Linear(width, width)
            self.fixed.requires_grad_(False)
            self.unused = nn.Parameter(torch.randn(width))
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.frozen:
            h = torch.tanh(self.fixed(h))
        return self.head(self.drop(h))


def build() -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
    torch.manual_seed(1234)
    model = Net()
    if env("CF_OPTIMIZERS", "one") == "two":
        weights = [p for n, p in model.body.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.body.named_parameters() if n.endswith("bias")]
        extra = [model.unused] if getattr(model, "frozen", False) else []
        body = torch.optim.AdamW(
            [
                {"params": weights + extra, "lr": 3e-3, "weight_decay": 0.05},
                {"params": biases, "lr": 1e-2, "weight_decay": 0.0},
            ]
        )
        head = torch.optim.SGD(model.head.parameters(), lr=5e-2, momentum=0.9)
        optimizers = [body, head]
    else:
        optimizers = [torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)]
    scheduler = torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=4, gamma=0.7)
    return model, optimizers, scheduler


def hit(point: str, step: int) -> None:
    if (point, member, step) == (fault_point, fault_member, fault_step):
        os.kill(os.getpid(), fault_signal)


built = build() if env("CF_BUILD", "after") == "before" else None


def warm_up() -> None:
    assert built is not None
    model, optimizers, _ = built
    nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1)).backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad()
    time.sleep(float(env("CF_WARM_UP_S", "0")))


job = torchrelay.init(warm_up=warm_up if built is not None else None)
model, optimizers, scheduler = built if built is not None else build()
job.track(model=model, scheduler=scheduler, **{f"opt{i}": o for i, o in enumerate(optimizers)})

gen = torch.Generator().manual_seed(99)
x = torch.randn(640, 16, generator=gen)
y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(640, 1, generator=gen)
data = TensorDataset(x, y)

current = {"step": -1}
model.register_forward_pre_hook(lambda _m, _a: hit("forward", current["step"]))
for opt in optimizers[:1]:
    opt.register_step_pre_hook(lambda _o, _a, _k: hit("optimizer", current["step"]))

for step, (xb, yb) in job.batches(data, batch_size=8, max_steps=steps, seed=3):
    current["step"] = step
    loss = nn.functional.mse_loss(model(xb), yb)
    loss.register_hook(lambda g, s=step: (hit("backward", s), g)[1])
    loss.backward()
    committed = job.step(*optimizers)
    if env("CF_SCHED", "inside") == "outside" or committed:
        scheduler.step()
    for opt in optimizers:
        opt.zero_grad()
    hit("between", step)
    if pause:
        time.sleep(pause)

out = Path(os.environ["TORCHRELAY_RUN_DIR"]) / f"{member}.digest.json"
out.write_text(json.dumps({"member_id": member, "rank": job.rank, "digest": job.state_digest()}))
job.finish()
