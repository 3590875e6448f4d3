"""Process groups per generation, and waiting on them without ever blocking for good.

Three pitfalls shape this module (docs/design.md §4):

- Dropping the last reference to a gloo group with a collective in flight blocks in its
  destructor until the collective times out. Abandoned groups are handed to a daemon
  thread that keeps them forever; the interpreter never finalises a daemon thread's
  frame, so not even the process exit waits for them.
- In a ring all-reduce only the dead rank's neighbours fail at once; the others would sit
  until the timeout. So the training thread waits on one wake-up event that a collective's
  completion callback, the generation watcher and group formation all set, and it leaves
  the collective the moment a newer generation is known.
- Group formation (store connect, gloo/NCCL rendezvous) blocks until every member shows
  up, so it runs on a helper thread and is abandoned the same way.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class Abandoned(Exception):
    """A newer generation appeared while waiting: leave this group."""


class CollectiveError(RuntimeError):
    """A collective or the group's formation failed (a peer vanished, a timeout)."""

    def __init__(self, message: str, peer_rank: int | None = None) -> None:
        super().__init__(message)
        self.peer_rank = peer_rank


class Wakeup:
    """The training thread's single wake-up: set by whoever may have changed its world."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        """Wake the training thread (callable from any thread)."""
        self._event.set()

    def wait_for(
        self, ready: Callable[[], bool], stale: Callable[[], bool], slice_s: float = 1.0
    ) -> None:
        """Block until ``ready()``; raise :class:`Abandoned` as soon as ``stale()``.

        Both predicates are re-checked after every wake-up, and at least every
        ``slice_s`` seconds in case a waker was missed.
        """
        while True:
            self._event.clear()
            if ready():
                return
            if stale():
                raise Abandoned
            self._event.wait(slice_s)


class _Graveyard:
    """Keeps abandoned groups (and their pending work) alive on a daemon thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.in_flight = False

    def keep(self, *objects: Any, in_flight: bool = False) -> None:
        """Hold ``objects`` until the process ends, off the training thread.

        ``in_flight`` marks a group left with a collective still pending: such a group can
        abort the process when its peers close their sockets during the interpreter's
        shutdown, so the agent ends such a process with ``os._exit`` (see ``_job``).
        """
        if in_flight:
            self.in_flight = True
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._hold, args=(self._queue,), name="torchrelay-graveyard", daemon=True
                )
                self._thread.start()
        self._queue.put(objects)

    @staticmethod
    def _hold(q: queue.SimpleQueue[Any]) -> None:
        kept: list[Any] = []
        while True:
            item = q.get()
            for obj in item:
                if callable(obj):  # a teardown action (NCCL abort), run off the training thread
                    try:
                        obj()
                    except Exception:  # noqa: S112 - best-effort teardown of a dead group
                        continue
            kept.append(item)


GRAVEYARD = _Graveyard()


class Backend:
    """Builds process groups and tensors for one device kind (gloo on CPU, NCCL on CUDA)."""

    def __init__(
        self, name: str, device: torch.device, timeout_s: float, host: str = "127.0.0.1"
    ) -> None:
        self.name = name
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.host = host

    @classmethod
    def detect(cls, gpu: int, timeout_s: float, host: str) -> Backend:
        """NCCL on this process's CUDA device when CUDA is usable, else gloo on CPU.

        ``TORCHRELAY_BACKEND=gloo`` forces gloo (e.g. CPU training on a GPU machine).
        """
        wanted = os.environ.get("TORCHRELAY_BACKEND", "").lower()
        if wanted != "gloo" and torch.cuda.is_available() and dist.is_nccl_available():
            index = gpu % max(1, torch.cuda.device_count())
            torch.cuda.set_device(index)
            # We watch and abandon collectives ourselves; NCCL's watchdog must not kill
            # the process when an abandoned collective times out.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
            # An aborted (abandoned) communicator must not trip the watchdog's heartbeat
            # monitor, which would kill the process.
            os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
            return cls("nccl", torch.device("cuda", index), timeout_s, host)
        # Lazy gloo pairs: a new group connects each pair on its first use instead of the
        # full mesh in the constructor, which took 30-50 ms for 4 ranks on a loaded 2-core
        # machine (and the formation is on the stall of every migration). Read by torch when
        # each group is built; a user's explicit setting wins.
        os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
        return cls("gloo", torch.device("cpu"), timeout_s, host)

    def make_group(self, store: Any, rank: int, world_size: int) -> Any:
        """A fresh process group (no default group) on ``store``; blocks for rendezvous."""
        if self.name == "nccl":
            from torch.distributed import ProcessGroupNCCL

            nccl_opts = ProcessGroupNCCL.Options()
            nccl_opts._timeout = self.timeout
            pg = ProcessGroupNCCL(store, rank, world_size, nccl_opts)
            # NCCL creates communicators lazily; connect now so that a dead peer is found
            # during formation (which can be abandoned) rather than in the first step.
            if hasattr(pg, "eager_connect_single_device"):
                pg.eager_connect_single_device(self.device)
            return pg
        from torch.distributed import ProcessGroupGloo

        gloo_opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        gloo_opts._timeout = self.timeout
        gloo_opts._devices = [ProcessGroupGloo.create_device(hostname=self.host)]
        return ProcessGroupGloo(store, rank, world_size, gloo_opts)

    def abandon(self, pg: Any, *pending: Any) -> None:
        """Leave ``pg`` for good without blocking: NCCL is aborted off-thread, gloo kept."""
        if self.name == "nccl" and hasattr(pg, "abort"):
            GRAVEYARD.keep(pg.abort, pg, *pending, in_flight=bool(pending))
        else:
            GRAVEYARD.keep(pg, *pending, in_flight=bool(pending))


def wait_work(work: Any, wakeup: Wakeup, stale: Callable[[], bool]) -> None:
    """Wait for a collective; raise Abandoned if ``stale()`` first, CollectiveError if it fails.

    On Abandoned the caller owns ``work`` and must hand it (and its group) to
    :meth:`Backend.abandon`.
    """
    try:
        fut = work.get_future()
    except RuntimeError:  # gloo send/recv have no future: a helper thread waits instead
        _wait_on_thread(work, wakeup, stale)
        return
    fut.add_done_callback(lambda _f: wakeup.set())
    wakeup.wait_for(fut.done, stale)
    try:
        fut.wait()
    except Exception as exc:
        raise CollectiveError(str(exc).splitlines()[0][:2000]) from exc


def _wait_on_thread(work: Any, wakeup: Wakeup, stale: Callable[[], bool]) -> None:
    box: dict[str, Any] = {}

    def _wait() -> None:
        try:
            work.wait()
            box["ok"] = True
        except Exception as exc:
            box["error"] = exc
        wakeup.set()

    threading.Thread(target=_wait, name="torchrelay-p2p-wait", daemon=True).start()
    wakeup.wait_for(lambda: bool(box), stale)
    if "error" in box:
        raise CollectiveError(str(box["error"]).splitlines()[0][:2000]) from box["error"]


def form_group(
    backend: Backend,
    make_store: Callable[[], Any],
    rank: int,
    world_size: int,
    wakeup: Wakeup,
    stale: Callable[[], bool],
) -> Any:
    """Build a process group on a helper thread; abandonable while the rendezvous waits.

    Raises:
        Abandoned: a newer generation appeared first (the group, if it is built later,
            goes to the graveyard).
        CollectiveError: the store or the rendezvous failed.
    """
    lock = threading.Lock()
    box: dict[str, Any] = {}

    def _build() -> None:
        try:
            pg = backend.make_group(make_store(), rank, world_size)
        except Exception as exc:
            with lock:
                box["error"] = exc
        else:
            with lock:
                if box.get("abandoned"):
                    backend.abandon(pg)
                else:
                    box["pg"] = pg
        wakeup.set()

    threading.Thread(target=_build, name="torchrelay-rendezvous", daemon=True).start()
    try:
        wakeup.wait_for(lambda: "pg" in box or "error" in box, stale)
    except Abandoned:
        with lock:
            box["abandoned"] = True
            if "pg" in box:
                backend.abandon(box.pop("pg"))
        raise
    if "error" in box:
        raise CollectiveError(f"forming the process group failed: {box['error']}")
    return box["pg"]


__all__ = [
    "GRAVEYARD",
    "Abandoned",
    "Backend",
    "CollectiveError",
    "Wakeup",
    "form_group",
    "wait_work",
]
