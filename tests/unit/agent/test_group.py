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
