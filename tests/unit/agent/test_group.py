"""Waiting on gloo groups: a stuck rendezvous or collective is left the moment it is stale.

Real gloo groups inside this process (ranks on threads), no NATS.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from torchrelay.agent._group import Abandoned, Backend, Wakeup, form_group, wait_work
from torchrelay.agent._job import _flatten, _unflatten

TIMEOUT_S = 60.0  # far longer than any wait below: leaving must not come from a timeout


def server() -> TCPStore:
    return TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )


def client(port: int, prefix: str) -> PrefixStore:
    return PrefixStore(
        prefix,
        TCPStore(
            "127.0.0.1",
            port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        ),
    )


def test_a_rendezvous_missing_a_member_is_abandoned_on_a_newer_generation() -> None:
    store = server()
    backend = Backend("gloo", torch.device("cpu"), TIMEOUT_S)
    wakeup = Wakeup()
    newer = threading.Event()
    threading.Timer(0.3, lambda: (newer.set(), wakeup.set())).start()
    started = time.monotonic()
    with pytest.raises(Abandoned):
        form_group(backend, lambda: client(store.port, "g1"), 0, 2, wakeup, newer.is_set)
    assert time.monotonic() - started < 5
    # The missing member turns up after all: the abandoned rendezvous completes and its
    # thread ends here, not at the store timeout (which, firing while the test process
    # shuts down, aborts it: a daemon thread woken then is unwound through C++).
    late = backend.make_group(client(store.port, "g1"), 1, 2)
    backend.abandon(late)


def test_a_stuck_allreduce_is_left_at_once_and_a_finished_one_returns() -> None:
    store = server()
    backend = Backend("gloo", torch.device("cpu"), TIMEOUT_S)
    groups: dict[int, object] = {}

    def build(rank: int) -> None:
        groups[rank] = backend.make_group(client(store.port, "g1"), rank, 2)

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    pg0, pg1 = groups[0], groups[1]
    wakeup = Wakeup()

    # Both ranks take part: the sum arrives and wait_work returns.
    a, b = torch.ones(4), torch.full((4,), 2.0)
    w1 = pg1.allreduce([b], dist.AllreduceOptions())  # type: ignore[attr-defined]
    wait_work(
        pg0.allreduce([a], dist.AllreduceOptions()),
        wakeup,  # type: ignore[attr-defined]
        lambda: False,
    )
    w1.wait()
    assert a.tolist() == [3.0] * 4

    # Rank 1 never joins the next one (it hangs): rank 0 leaves once a newer generation shows.
    newer = threading.Event()
    threading.Timer(0.3, lambda: (newer.set(), wakeup.set())).start()
    work = pg0.allreduce([torch.ones(4)], dist.AllreduceOptions())  # type: ignore[attr-defined]
    started = time.monotonic()
    with pytest.raises(Abandoned):
        wait_work(work, wakeup, newer.is_set)
    assert time.monotonic() - started < 5
    backend.abandon(pg0, work)  # kept alive off-thread: dropping it here would block
    # Rank 1 comes back: the abandoned all-reduce completes instead of timing out later.
    pg1.allreduce([torch.ones(4)], dist.AllreduceOptions()).wait()  # type: ignore[attr-defined]
    work.wait()
    backend.abandon(pg1)


def test_gradients_flatten_with_the_flag_and_come_back_as_the_mean() -> None:
    model = torch.nn.Linear(3, 2)
    model(torch.randn(5, 3)).sum().backward()
    params = list(model.parameters())
    grads = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    flat = _flatten(params, torch.device("cpu"), 1.0)
    assert flat.numel() == sum(p.numel() for p in params) + len(params) + 1
    assert flat[-1].item() == 1.0
    flat[:-1].mul_(2)  # what a 2-rank all-reduce of the same gradients gives
    _unflatten(flat, params, 2)
    for p, g in zip(params, grads, strict=True):
        assert torch.equal(p.grad, g)  # type: ignore[arg-type]


def test_a_parameter_no_rank_has_a_gradient_for_keeps_none() -> None:
    # Like one process: a parameter outside this step's graph keeps grad None, so AdamW
    # neither decays it nor moves its moments; one that some rank has gets the mean.
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.ones(2, 3)
    params = list(model.parameters())
    flat = _flatten(params, torch.device("cpu"), 0.0)
    other = _flatten(params, torch.device("cpu"), 0.0)
    other[:6].fill_(3.0)  # a second rank: the weight's gradient is 3s there, bias none too
    flat.add_(other)
    _unflatten(flat, params, 2)
    assert torch.equal(model.weight.grad, torch.full((2, 3), 2.0))  # type: ignore[arg-type]
    assert model.bias.grad is None


def test_the_step_buffer_is_reused_when_it_fits_and_replaced_when_it_does_not() -> None:
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    first = _flatten(params, torch.device("cpu"), 0.0)
    expected = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
    assert torch.equal(first[: expected.numel()], expected)
    model.zero_grad()  # gradients set to None: their slots must read zero, not last step's
    again = _flatten(params, torch.device("cpu"), 1.0, first)
    assert again.data_ptr() == first.data_ptr()
    assert torch.count_nonzero(again[:-1]).item() == 0  # no gradient, none counted
    assert again[-1].item() == 1.0
    other = torch.nn.Linear(4, 2)
    other(torch.randn(5, 4)).sum().backward()
    bigger = _flatten(list(other.parameters()), torch.device("cpu"), 0.0, first)
    assert bigger.data_ptr() != first.data_ptr()
    assert bigger.numel() == sum(p.numel() for p in other.parameters()) + 2 + 1
