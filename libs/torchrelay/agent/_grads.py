"""The step's gradients in one buffer for the all-reduce, and back as their mean."""

from __future__ import annotations

import torch


def flatten_grads(
    params: list[torch.nn.Parameter],
    device: torch.device,
    flag: float | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One buffer of every gradient (zeros where a parameter has none), one count per
    parameter of the ranks that have its gradient, and the flag last (if not None).

    After the all-reduce a parameter that no rank has a gradient for keeps none (like a
    single process, the optimizer then leaves it alone); one that some ranks have gets the
    mean with zeros for the others. Written into ``out`` when it has the right size, dtype
    and device (the step's buffer is kept from one step to the next: a fresh one of the
    model's size each step costs page faults that, on a loaded host, took longer than the
    copy itself), else into a new one.
    """
    dtypes = {p.dtype for p in params}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    numel = sum(p.numel() for p in params)
    total = numel + len(params) + (flag is not None)
    if out is None or out.numel() != total or out.dtype != dtype or out.device != device:
        out = torch.empty(total, dtype=dtype, device=device)
    offset = 0
    for p in params:
        n = p.numel()
        part = out[offset : offset + n]
        if p.grad is None:
            part.zero_()
        else:
            part.copy_(p.grad.reshape(-1))
        offset += n
    # The counts and the flag in one copy: a write per parameter is one op each, on the
    # step's path for every parameter tensor of the model.
    tail = [0.0 if p.grad is None else 1.0 for p in params]
    if flag is not None:
        tail.append(flag)
    out[numel:].copy_(torch.tensor(tail, dtype=dtype))
    return out


def unflatten_grads(flat: torch.Tensor, params: list[torch.nn.Parameter], world_size: int) -> None:
    """The all-reduced buffer of :func:`flatten_grads` back into the mean gradients."""
    numel = sum(p.numel() for p in params)
    grads = flat[:numel]
    present = flat[numel : numel + len(params)].tolist()
    offset = 0
    for p, count in zip(params, present, strict=True):
        n = p.numel()
        part = grads[offset : offset + n].view_as(p)
        offset += n
        if count == 0:
            p.grad = None
        elif p.grad is None:
            p.grad = torch.div(part, world_size).to(p.dtype)
        elif p.grad.dtype == flat.dtype and p.grad.is_contiguous():
            # The mean written straight into the gradient: one pass over the buffer instead
            # of a division and then a copy (the same division, so the same bits).
            torch.div(part, world_size, out=p.grad)
        else:
            p.grad.copy_(torch.div(part, world_size))  # divided in the buffer's dtype, cast
