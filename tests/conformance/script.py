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
  CF_LOOP        "step" (job.step) or "llm": job.reduce_gradients, then GradScaler.unscale_,
                 clip_grad_norm_ of the global gradient, a logged norm, GradScaler.step and
                 update (the scaler tracked), under autocast(bf16)
  CF_ACCUM       micro-batches per step (gradient accumulation)
  CF_DATA        "map" (the dataset to job.batches), "loader" (DataLoader on job.sampler
                 with 2 workers, pin_memory, prefetch) or "stream" (StatefulDataLoader over
                 an iterable dataset sharded by rank and worker)
  CF_COMPILE     a torch.compile backend for the model ("" for none)
  CF_FAULT       "POINT:MEMBER:STEP:SIGNAL": MEMBER sends itself SIGNAL (KILL or STOP) at
                 POINT of STEP, POINT one of forward, backward, late_backward (the first
                 layer's gradient: the last of backward, after the overlap's first buckets),
                 clip (after the all-reduce, before the optimizers step), optimizer, between
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
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, get_worker_info

import torchrelay
import torchrelay.agent

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


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """An endless stream, sharded by rank and by loader worker, that knows its position."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.next: int | None = None  # the next sample this worker yields

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        i = self.next if self.next is not None else worker
        while True:
            g = torch.Generator().manual_seed(1_000_003 * self.rank + i)
            x = torch.randn(16, generator=g)
            self.next = i = i + workers
            yield x, torch.sin(x.sum()).reshape(1) + 0.1 * torch.randn(1, generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next = state["next"]


job = torchrelay.init(warm_up=warm_up if built is not None else None)
model, optimizers, scheduler = built if built is not None else build()
loop = env("CF_LOOP", "step")
accum = int(env("CF_ACCUM", "1"))
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
tracked: dict[str, Any] = {"model": model, "scheduler": scheduler}
tracked.update({f"opt{i}": o for i, o in enumerate(optimizers)})
if loop == "llm":
    tracked["scaler"] = scaler
job.track(**tracked)
net = torch.compile(model, backend=env("CF_COMPILE")) if env("CF_COMPILE") else model

gen = torch.Generator().manual_seed(99)
x = torch.randn(640, 16, generator=gen)
y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(640, 1, generator=gen)
data = TensorDataset(x, y)
source: Any = data
kind = env("CF_DATA", "map")
if kind == "loader":
    source = DataLoader(
        data,
        batch_sampler=job.sampler(data, batch_size=8, seed=3),
        num_workers=2,
        pin_memory=True,
        prefetch_factor=2,
        persistent_workers=True,
    )
elif kind == "stream":
    from torchdata.stateful_dataloader import StatefulDataLoader

    source = StatefulDataLoader(Stream(job.rank), batch_size=8, num_workers=2)

current = {"step": -1}
model.register_forward_pre_hook(lambda _m, _a: hit("forward", current["step"]))
for opt in optimizers[:1]:
    opt.register_step_pre_hook(lambda _o, _a, _k: hit("optimizer", current["step"]))
first = next(model.body.parameters())
first.register_post_accumulate_grad_hook(lambda _p: hit("late_backward", current["step"]))


def losses(batch: Any) -> Any:
    """The step's micro-batches (one unless CF_ACCUM)."""
    return [batch] if accum == 1 else batch


batch_size = None if kind != "map" else 8
for step, batch in job.batches(source, batch_size, max_steps=steps, seed=3, accumulate=accum):
    current["step"] = step
    for xb, yb in losses(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=loop == "llm"):
            loss = nn.functional.mse_loss(net(xb).float(), yb) / accum
        loss.register_hook(lambda g, s=step: (hit("backward", s), g)[1])
        (scaler.scale(loss) if loop == "llm" else loss).backward()
    if loop == "llm":
        committed = job.reduce_gradients(*optimizers)
        if committed:
            hit("clip", step)
            for opt in optimizers:
                scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            if step % 5 == 0:
                print(f"step {step} grad norm {norm.item():.6f}", flush=True)
            for opt in optimizers:
                scaler.step(opt)
            scaler.update()
    else:
        committed = job.step(*optimizers)
    if env("CF_SCHED", "inside") == "outside" or committed:
        scheduler.step()
    for opt in optimizers:
        opt.zero_grad()
    hit("between", step)
    if pause:
        time.sleep(pause)

out = Path(os.environ["TORCHRELAY_RUN_DIR"]) / f"{member}.digest.json"
# Each tracked object's digest too: a cell that differs names what differs.
parts = {name: torchrelay.agent.state_digest({name: obj}) for name, obj in tracked.items()}
record = {"member_id": member, "rank": job.rank, "digest": job.state_digest(), "parts": parts}
out.write_text(json.dumps(record))
job.finish()
