"""The step's gradient buffer: one all-reduce carries the gradients, who has them, a flag."""

from __future__ import annotations

import torch

from torchrelay.agent._grads import flatten_grads, unflatten_grads


def test_gradients_flatten_with_the_flag_and_come_back_as_the_mean() -> None:
    model = torch.nn.Linear(3, 2)
    model(torch.randn(5, 3)).sum().backward()
    params = list(model.parameters())
    grads = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    flat = flatten_grads(params, torch.device("cpu"), 1.0)
    assert flat.numel() == sum(p.numel() for p in params) + len(params) + 1
    assert flat[-1].item() == 1.0
    flat[:-1].mul_(2)  # what a 2-rank all-reduce of the same gradients gives
    unflatten_grads(flat, params, 2)
    for p, g in zip(params, grads, strict=True):
        assert torch.equal(p.grad, g)  # type: ignore[arg-type]


def test_a_parameter_no_rank_has_a_gradient_for_keeps_none() -> None:
    # Like one process: a parameter outside this step's graph keeps grad None, so AdamW
    # neither decays it nor moves its moments; one that some rank has gets the mean.
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.ones(2, 3)
    params = list(model.parameters())
    flat = flatten_grads(params, torch.device("cpu"), 0.0)
    other = flatten_grads(params, torch.device("cpu"), 0.0)
    other[:6].fill_(3.0)  # a second rank: the weight's gradient is 3s there, bias none too
    flat.add_(other)
    unflatten_grads(flat, params, 2)
    assert torch.equal(model.weight.grad, torch.full((2, 3), 2.0))  # type: ignore[arg-type]
    assert model.bias.grad is None


def test_the_step_buffer_is_reused_when_it_fits_and_replaced_when_it_does_not() -> None:
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    first = flatten_grads(params, torch.device("cpu"), 0.0)
    expected = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
    assert torch.equal(first[: expected.numel()], expected)
    model.zero_grad()  # gradients set to None: their slots must read zero, not last step's
    again = flatten_grads(params, torch.device("cpu"), 1.0, first)
    assert again.data_ptr() == first.data_ptr()
    assert torch.count_nonzero(again[:-1]).item() == 0  # no gradient, none counted
    assert again[-1].item() == 1.0
    other = torch.nn.Linear(4, 2)
    other(torch.randn(5, 4)).sum().backward()
    bigger = flatten_grads(list(other.parameters()), torch.device("cpu"), 0.0, first)
    assert bigger.data_ptr() != first.data_ptr()
    assert bigger.numel() == sum(p.numel() for p in other.parameters()) + 2 + 1


def test_the_mean_is_bitwise_a_division_of_the_sum_whatever_the_gradient_held() -> None:
    # The mean goes straight into the gradient (kept, set to None, or cast to a parameter
    # of another dtype): every case must give the bits of dividing the summed buffer by
    # the world size in the buffer's dtype.
    torch.manual_seed(0)
    wide, narrow = torch.nn.Linear(7, 5), torch.nn.Linear(7, 5).to(torch.bfloat16)
    for params, set_to_none in (
        (list(wide.parameters()), False),
        (list(wide.parameters()), True),
        (list(wide.parameters()) + list(narrow.parameters()), False),  # fp32 buffer
        (list(wide.parameters()) + list(narrow.parameters()), True),
    ):
        for p in params:
            p.grad = torch.randn_like(p)
        flat = flatten_grads(params, torch.device("cpu"), 0.0)
        numel = sum(p.numel() for p in params)
        flat[:numel].mul_(3.7)  # a sum over three ranks, inexact in binary
        expected = flat[:numel] / 3
        if set_to_none:
            for p in params:
                p.grad = None  # zero_grad(): the buffer's count still says present
        unflatten_grads(flat, params, 3)
        offset = 0
        for p in params:
            want = expected[offset : offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
            assert p.grad is not None
            assert p.grad.dtype == p.dtype
            assert torch.equal(p.grad, want)
