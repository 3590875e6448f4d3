"""A sharded training script on torchrelay's documented API (run under ``torchrelay run``).

``TR_MESH`` picks the parallelism over ``job.device_mesh``: ``fsdp`` (FSDP2, 1-D, every
rank its own shard), ``replicated`` (no mesh: torchrelay's data parallelism), ``hsdp``
(FSDP2 over 2 replicas of world/2 shards) or ``tp`` (tensor parallel over world/2 ranks
inside 2 data-parallel replicas, whose gradients the script averages itself over the
mesh's ``dp`` group, its inputs drawn from the step and the replica so that both ranks of
a TP group see the same batch). ``TR_STEPS`` steps of AdamW, the global gradient clipped
(at a norm low enough that it always clips) but under TP.

``TR_KILL_AT=POINT:STEP:RANK[+RANK...]`` kills the workers started as those ranks at a
point of a step the script reaches itself (:func:`maybe_die`); ``TR_HANG_AT=STEP:RANK``
makes that rank's first worker stop before STEP's forward, as on a GPU that fell off the
bus, after writing <member_id>.hung.json with its node and GPU (for the test to inject
the GPU's fault there); ``TR_CORRUPT_RANK=r``
perturbs rank r's shard after step 4 (what the divergence guard must catch). At the end
each rank writes <TORCHRELAY_RUN_DIR>/<member_id>.digest.json with the sha256 of its
tracked state (its shards). ``TR_FULL_AT=STEP`` (or ``end``) adds "full": the sha256 of
the whole unsharded state, gathered before STEP's forward (or after the last step): the
same at any world size. The model is ``Linear(16, W)``, ``TR_HIDDEN`` (1) layers
``Linear(W, W)`` and ``Linear(W, 1)`` with ``W = TR_WIDTH`` (64); the digest file also
holds each step's start time (``step_times``) and the peak resident memory
(``max_rss_bytes``). ``TR_STEP_SLEEP`` (seconds) makes each step that much longer.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import TensorDataset

torch.set_num_threads(1)

import torchrelay  # noqa: E402 - after the thread setting, like a user script would
from torchrelay.agent import state_digest  # noqa: E402

steps = int(os.environ.get("TR_STEPS", "12"))
run_dir = Path(os.environ["TORCHRELAY_RUN_DIR"])
member = os.environ["TORCHRELAY_MEMBER_ID"]

job = torchrelay.init()
kind = os.environ.get("TR_MESH", "fsdp")
half = (2, job.world_size // 2)
if kind == "fsdp":
    mesh = job.device_mesh(job.world_size, mesh_dim_names=("shard",))
elif kind == "hsdp":
    mesh = job.device_mesh(half, mesh_dim_names=("replicate", "shard"))
elif kind == "tp":
    mesh = job.device_mesh(half, mesh_dim_names=("dp", "tp"))
torch.manual_seed(1234)
width = int(os.environ.get("TR_WIDTH", "64"))
layers: list[nn.Module] = [nn.Linear(16, width), nn.ReLU()]
for _ in range(int(os.environ.get("TR_HIDDEN", "1"))):
    layers += [nn.Linear(width, width), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(width, 1))
if kind == "tp":
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
elif kind != "replicated":
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
job.track(model=model, optimizer=optimizer)


kill_at = tuple(os.environ.get("TR_KILL_AT", "::").split(":"))


def maybe_die(point: str, step: int) -> None:
    """A worker SIGKILLs itself at POINT of STEP if it holds a RANK of ``TR_KILL_AT``
    (ranks joined by "+"; a spare that takes the rank over, or a worker of a checkpoint
    restart, ``JOB-rN-wI``, does not)."""
    worker = os.environ.get("TORCHRELAY_ROLE", "worker") == "worker"
    first = re.search(r"-r\d+-w\d+$", member) is None
    ranks = kill_at[2].split("+")
    if worker and first and (point, str(step)) == kill_at[:2] and str(job.rank) in ranks:
        os.kill(os.getpid(), signal.SIGKILL)


hang_at = os.environ.get("TR_HANG_AT", ":").split(":")


def maybe_hang(step: int) -> None:
    """Stop for good at STEP of ``TR_HANG_AT`` if this first worker holds its rank."""
    first = re.search(r"-r\d+-w\d+$", member) is None
    if first and [str(step), str(job.rank)] == hang_at:
        where = {"node": job.node, "gpu": job.gpu, "rank": job.rank, "step": step}
        (run_dir / f"{member}.hung.json").write_text(json.dumps(where))
        while True:
            time.sleep(60)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _Whole:
    """A tracked object's state with every DTensor gathered whole (a collective)."""

    def __init__(self, obj: nn.Module | torch.optim.Optimizer) -> None:
        self.obj = obj

    def state_dict(self) -> object:
        def whole(value: object) -> object:
            if isinstance(value, DTensor):
                return value.full_tensor()
            if isinstance(value, dict):
                return {k: whole(v) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return [whole(v) for v in value]
            return value

        return whole(self.obj.state_dict())

    def load_state_dict(self, state: object) -> None:
        raise NotImplementedError("a digest view only")


def full_digest() -> str:
    """sha256 of the whole unsharded state: the project's digest over gathered tensors."""
    return state_digest({"model": _Whole(model), "optimizer": _Whole(optimizer)})


full_at = os.environ.get("TR_FULL_AT")
full: str | None = None
step_times: list[float] = []
g = torch.Generator().manual_seed(7)
data = TensorDataset(torch.randn(512, 16, generator=g), torch.randn(512, 1, generator=g))
for step, (x, y) in job.batches(data, batch_size=8, max_steps=steps):
    if kind == "tp":  # one batch per replica: the TP group's ranks must see the same input
        replica = job.rank // half[1]
        step_gen = torch.Generator().manual_seed(10_000 * step + replica)
        x, y = torch.randn(8, 16, generator=step_gen), torch.randn(8, 1, generator=step_gen)
    step_times.append(time.perf_counter())
    if full_at == str(step):
        full = full_digest()
    maybe_hang(step)
    time.sleep(float(os.environ.get("TR_STEP_SLEEP", "0")))
    maybe_die("forward", step)
    loss = nn.functional.mse_loss(model(x), y)
    maybe_die("backward", step)
    loss.backward()
    if kind == "tp":
        for p in model.parameters():
            grad = local(p.grad)
            dist.all_reduce(grad, group=mesh.get_group("dp"))
            grad.div_(half[0])
    if job.reduce_gradients(optimizer):
        maybe_die("clip", step)
        if kind != "tp":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        maybe_die("optimizer", step)
        optimizer.step()
        maybe_die("after", step)
        if os.environ.get("TR_CORRUPT_RANK") == str(job.rank) and step == 4:
            with torch.no_grad():  # one bit of drift in this rank's shard (the guard's test)
                local(next(model.parameters())).view(-1)[0] += 1.0
    optimizer.zero_grad()

if full_at == "end":
    full = full_digest()
digest = job.state_digest()
(run_dir / f"{member}.digest.json").write_text(
    json.dumps(
        {
            "member_id": member,
            "rank": job.rank,
            "digest": digest,
            "step": job.committed_step,
            "full": full,
            "step_times": step_times,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
    )
)
job.finish()
