"""The DDP comparison's training script, run under ``torchrelay run`` (see ``ddp.py``).

Each rank alternates blocks of steps under ``torch.nn.parallel.DistributedDataParallel``
(its own gloo group of the same ranks, built directly) with blocks of torchrelay steps
(``job.batches`` / ``job.step``), same model, same data, same optimizer, so both see the same
machine load. Writes, per rank, the step gaps of each kind to
``<TORCHRELAY_RUN_DIR>/<member_id>.ddp.json``.

Env: TR_BLOCKS, TR_BLOCK_STEPS, TR_PLAIN_PORT, TR_LAYERS, TR_DIM, TR_VOCAB, TR_SEQ, TR_BATCH.
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

from torch._C._distributed_c10d import PrefixStore, TCPStore  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import torchrelay  # noqa: E402
from torchrelay.agent._data import StepSampler, make_batch  # noqa: E402

env = os.environ.get
layers, dim = int(env("TR_LAYERS", "6")), int(env("TR_DIM", "512"))
vocab, seq = int(env("TR_VOCAB", "8192")), int(env("TR_SEQ", "64"))
batch = int(env("TR_BATCH", "4"))
blocks, per_block = int(env("TR_BLOCKS", "4")), int(env("TR_BLOCK_STEPS", "6"))


class LM(nn.Module):
    """A small decoder-only transformer (pre-norm, causal), untied embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        block = nn.TransformerEncoderLayer(
            dim, dim // 64, 4 * dim, dropout=0.1, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        h = self.blocks(h, mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1234)
    model = LM()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))


job = torchrelay.init()
rank, world = job.rank, job.world_size
timeout = datetime.timedelta(seconds=300)
store = TCPStore(
    "127.0.0.1",
    int(os.environ["TR_PLAIN_PORT"]),
    is_master=rank == 0,
    wait_for_workers=False,
    timeout=timeout,
)
# DDP's group is the default one, as torchrun scripts make it (the agent uses its own).
torch.distributed.init_process_group(
    "gloo", store=PrefixStore("ddp", store), rank=rank, world_size=world, timeout=timeout
)

tokens = torch.randint(0, vocab, (512, seq + 1), generator=torch.Generator().manual_seed(5))
data = TensorDataset(tokens)
sampler = StepSampler(len(data), batch, world, seed=7)

ddp_model, ddp_opt = build()
# DDP at its documented best for a fixed graph: gradients as views of its buckets (no copy)
# and a static graph; buckets of the default 25 MB, as torchrelay's.
ddp = DistributedDataParallel(ddp_model, gradient_as_bucket_view=True, static_graph=True)
agent_model, agent_opt = build()
job.track(model=agent_model, optimizer=agent_opt)

ddp_gaps: list[float] = []
agent_gaps: list[float] = []
ddp_step = 0


def ddp_block() -> None:
    global ddp_step
    last = None
    for _ in range(per_block):
        (xb,) = make_batch(data, sampler.indices(ddp_step, rank), None)
        torch.manual_seed(ddp_step)
        loss_of(ddp, xb).backward()
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=False)  # a bucket view must stay the gradient
        ddp_step += 1
        now = time.perf_counter()
        if last is not None:
            ddp_gaps.append(now - last)
        last = now


def agent_block() -> None:
    last = None
    target = job.committed_step + 1 + per_block
    for _step, (xb,) in job.batches(data, batch_size=batch, max_steps=target, seed=7):
        loss_of(agent_model, xb).backward()
        job.step(agent_opt)
        agent_opt.zero_grad()
        now = time.perf_counter()
        if last is not None:
            agent_gaps.append(now - last)
        last = now


# Alternate which kind goes first, so neither always follows the other.
for index in range(blocks):
    first, second = (ddp_block, agent_block) if index % 2 == 0 else (agent_block, ddp_block)
    first()
    second()

torch.distributed.barrier()
member = os.environ["TORCHRELAY_MEMBER_ID"]
out = Path(os.environ["TORCHRELAY_RUN_DIR"]) / f"{member}.ddp.json"
params = sum(p.numel() for p in agent_model.parameters())
out.write_text(json.dumps({"rank": rank, "ddp": ddp_gaps, "agent": agent_gaps, "params": params}))
job.finish()
