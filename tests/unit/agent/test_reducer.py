"""The overlap's buckets: their layout, launched in order during backward, the flag last."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchrelay.agent._reducer import OverlapMisuse, Reducer, layout


class Recording:
    """A one-rank gloo group that records each all-reduce's size and when it was asked."""

    def __init__(self) -> None:
        store = dist.HashStore()
        self.pg = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=10))
        self.sizes: list[int] = []
        self.refuse = False

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        if self.refuse:
            raise RuntimeError("Connection closed by peer")
        self.sizes.append(tensors[0].numel())
        return self.pg.allreduce(tensors, opts)


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def test_buckets_are_laid_out_backward_and_split_at_the_cap_and_at_a_dtype_change() -> None:
    a = torch.nn.Parameter(torch.zeros(100))  # 400 bytes
    b = torch.nn.Parameter(torch.zeros(100))
    c = torch.nn.Parameter(torch.zeros(50, dtype=torch.float64))  # 400 bytes, another dtype
    d = torch.nn.Parameter(torch.zeros(10))
    assert layout([a, b, c, d], None) == [[a, b, c, d]]
    assert layout([a, b, c, d], 1000) == [[d], [c], [b, a]]
    assert layout([a, b, d], 500) == [[d, b], [a]]


def test_the_backward_launches_every_bucket_but_the_last_in_order_while_it_runs() -> None:
    net = model()
    params = list(net.parameters())  # 8*32 + 32 + 32*4 + 4 floats
    group = Recording()
    reducer = Reducer(torch.device("cpu"), 600)  # the first layer's weight is 1 KiB
    reducer.set_params(params)
    launched_during: list[int] = []
    # The first layer's bias gradient is the backward's last: by then the later layers'
    # buckets are on their way.
    params[1].register_post_accumulate_grad_hook(
        lambda _p: launched_during.append(len(group.sizes))
    )
    reducer.arm(group, lambda: True)
    net(torch.randn(5, 8)).sum().backward()
    grads = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    assert launched_during, "the hook did not run"
    assert launched_during[0] >= 1
    works = reducer.launch(group, 1.0)
    buckets = layout(params, 600)
    assert len(works) == len(buckets) > 2
    # In layout order, each bucket its gradients and counts, the last one the flag too.
    expected = [sum(p.numel() for p in b) + len(b) for b in buckets]
    expected[-1] += 1
    assert group.sizes == expected
    for work in works:
        work.wait()
    assert reducer.finish(1) is True
    for p, g in zip(params, grads, strict=True):
        assert torch.equal(p.grad, g)  # type: ignore[arg-type]


def test_an_unarmed_backward_launches_nothing_and_a_repeat_uses_the_same_buckets() -> None:
    net = model()
    params = list(net.parameters())
    group = Recording()
    reducer = Reducer(torch.device("cpu"), 600)
    reducer.set_params(params)
    net(torch.randn(5, 8)).sum().backward()  # an earlier micro-batch: not armed
    assert group.sizes == []
    reducer.arm(group, lambda: True)
    net(torch.randn(5, 8)).sum().backward()
    first = reducer.launch(group, 0.0)
    for work in first:
        work.wait()
    sizes = list(group.sizes)
    # The all-reduce failed somewhere: a repeat launches the same buckets after backward.
    reducer.forget()
    group.sizes.clear()
    for work in reducer.launch(group, 0.0):
        work.wait()
    assert group.sizes == sizes
    assert reducer.finish(1) is False


def test_a_stale_group_or_state_still_arriving_launches_nothing_during_backward() -> None:
    net = model()
    group = Recording()
    reducer = Reducer(torch.device("cpu"), 600)
    reducer.set_params(list(net.parameters()))
    reducer.arm(group, lambda: False)
    net(torch.randn(5, 8)).sum().backward()
    assert group.sizes == []


def test_a_second_backward_in_the_last_micro_batch_is_refused_by_name() -> None:
    net = model()
    group = Recording()
    reducer = Reducer(torch.device("cpu"), 600)
    reducer.set_params(list(net.parameters()))
    reducer.arm(group, lambda: True)
    net(torch.randn(5, 8)).sum().backward()
    net(torch.randn(5, 8)).sum().backward()
    with pytest.raises(OverlapMisuse, match=r"accumulated twice .* backward\(\) once per micro"):
        reducer.launch(group, 0.0)


def test_a_group_that_refuses_a_bucket_during_backward_fails_the_launch() -> None:
    net = model()
    group = Recording()
    reducer = Reducer(torch.device("cpu"), 600)
    reducer.set_params(list(net.parameters()))
    reducer.arm(group, lambda: True)
    group.refuse = True
    net(torch.randn(5, 8)).sum().backward()  # the hook must not raise into autograd
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        reducer.launch(group, 0.0)


def test_without_overlap_one_flat_buffer_carries_everything_and_no_hook_is_set() -> None:
    net = model()
    params = list(net.parameters())
    group = Recording()
    reducer = Reducer(torch.device("cpu"), None)
    reducer.set_params(params)
    reducer.arm(group, lambda: True)
    net(torch.randn(5, 8)).sum().backward()
    assert group.sizes == []
    for work in reducer.launch(group, 0.0):
        work.wait()
    assert group.sizes == [sum(p.numel() for p in params) + len(params) + 1]
