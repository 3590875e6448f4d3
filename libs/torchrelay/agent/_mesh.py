"""Process groups for sharded jobs that outlive a generation (docs/design.md §12).

FSDP2, DTensor and ``DeviceMesh`` keep the process groups they were built with for the
module's whole life, while torchrelay forms a new gloo/NCCL group for every generation.
So the groups they hold are :class:`RelayGroup` objects: ``torch.distributed`` process
groups (registered as the ``torchrelay`` backend, default group included) whose every
collective goes to the transport bound for the current generation. A new generation
rebinds each one (:meth:`MeshGroups.rebind`); the mesh, the module and its optimizer never
learn of it.

This follows torchft's reconfigurable process groups (``ProcessGroupWrapper.configure``),
with one difference: torchft reconfigures only the replica dimension and restarts a whole
replica group, while here every group of the mesh (shard, replicate, tensor-parallel) is
rebound, because a spare takes one rank's place inside its shard group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, PrefixStore

from torchrelay.agent._group import GRAVEYARD, Abandoned, CollectiveError, Wakeup, wait_work

BACKEND_NAME = "torchrelay"

# The collectives FSDP2, DTensor and the functional collectives issue, and the rest of the
# ProcessGroup API a script may call: each one goes to the current generation's group.
_FORWARDED = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "all_gather_single",
    "_allgather_base",
    "reduce_scatter",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced",
    "alltoall",
    "alltoall_base",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
    "recv_anysource",
)


class UnboundGroupError(RuntimeError):
    """A collective on a :class:`RelayGroup` before any generation bound it."""


class RelayGroup(dist.ProcessGroup):
    """One group of a job's mesh, bound to a new transport in every generation.

    ``global_ranks`` are the job ranks it spans (all of them for the default group), in
    group-rank order, as ``torch.distributed.new_group`` gave them.
    """

    def __init__(self, rank: int, size: int, global_ranks: Sequence[int]) -> None:
        # torch's stubs know only the (store, rank, size) form; a Python group, as torchft's,
        # is built from its rank and size, and carries no store of its own.
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.global_ranks = tuple(global_ranks) or tuple(range(size))
        self._name: str | None = None
        self._inner: Any = None
        self.generation = 0
        # The registry that watches the job's generations: None for a group used on its
        # own (collectives then raise as over torch's groups).
        self.registry: MeshGroups | None = None

    @property
    def key(self) -> str:
        """The group's name in a generation's store: torch's group name (the same on every
        rank, which builds its groups in the same order) and its job ranks (for errors)."""
        return f"{self._name}:" + "-".join(str(r) for r in self.global_ranks)

    @property
    def group_name(self) -> str:  # type: ignore[override]  # torch's GroupName is a str
        if self._name is None:
            raise ValueError("the torchrelay process group has no name yet")
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def bind(self, generation: int, inner: Any) -> None:
        """Send every collective from now on to ``inner`` (a ``ProcessGroup``)."""
        if inner.size() != self.size() or inner.rank() != self.rank():
            raise ValueError(
                f"group {self.key}: generation {generation} binds a group of rank "
                f"{inner.rank()}/{inner.size()} to rank {self.rank()}/{self.size()}"
            )
        old, self._inner, self.generation = self._inner, inner, generation
        if old is not None:
            # Destroying a gloo group joins its threads, which wait out any collective the
            # last generation abandoned (up to the collective timeout): never here. (An
            # abandoned collective's RelayWork already marked the graveyard in flight.)
            GRAVEYARD.keep(old)

    @property
    def inner(self) -> Any:
        """The current generation's group (raises before the first binding)."""
        if self._inner is None:
            raise UnboundGroupError(
                f"torchrelay group {self.key} is used before the job's first generation "
                "formed: build the mesh with job.device_mesh() after torchrelay.init()"
            )
        return self._inner


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


class RelayWork(dist.Work):
    """A collective of a :class:`RelayGroup`: waiting never raises into the script.

    The wait watches the job's generations: when the collective fails (a peer vanished)
    or a newer generation means leaving it, the generation is poisoned
    (:attr:`MeshGroups.poisoned`), the collective's outputs are zeroed, and the wait
    returns. The script's forward, backward and optimizer step run on to the step's end,
    where the agent sees the poison and the step does not commit (docs/design.md §12).
    """

    def __init__(self, groups: MeshGroups, work: Any, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._groups, self._work, self._outputs = groups, work, outputs

    def wait(self, timeout: Any = None) -> bool:
        work, self._work = self._work, None
        if work is None:
            return True
        try:
            wait_work(work, self._groups.wakeup, self._groups.stale)
        except (Abandoned, CollectiveError) as exc:
            GRAVEYARD.keep(work, in_flight=True)  # it may still write into its buffers
            self._groups.poison(exc)
            for t in self._outputs:
                t.zero_()
        return True

    def is_completed(self) -> bool:
        return self._work is None or bool(self._work.is_completed())

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        self.wait()
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result(self._outputs)
        return fut


def _forward(name: str) -> Callable[..., Any]:
    def call(self: RelayGroup, *args: Any, **kwargs: Any) -> Any:
        groups = self.registry
        if groups is None:
            return getattr(self.inner, name)(*args, **kwargs)
        # What a poisoned collective leaves in its outputs: zeros (a send's buffer is the
        # script's own and stays as it is).
        outputs = [] if name == "send" or not args else _tensors(args[0])
        if groups.poisoned is None:
            try:
                return RelayWork(groups, getattr(self.inner, name)(*args, **kwargs), outputs)
            except RuntimeError as exc:  # the group refused it: it is broken
                groups.poison(CollectiveError(f"{name} could not start: {exc}"))
        for t in outputs:
            t.zero_()
        return RelayWork(groups, None, outputs)

    call.__name__ = name
    return call


for _name in _FORWARDED:
    setattr(RelayGroup, _name, _forward(_name))


def wrap_backend(backend: Any, store: Any, rank: int, size: int, device: torch.device) -> Any:
    """A ``ProcessGroup`` over one gloo/NCCL backend object (what a RelayGroup binds to)."""
    pg = dist.ProcessGroup(store, rank, size)
    kind = (
        dist.ProcessGroup.BackendType.NCCL
        if device.type == "cuda"
        else dist.ProcessGroup.BackendType.GLOO
    )
    pg._set_default_backend(kind)
    pg._register_backend(device, kind, backend)
    if device.type != "cpu":  # CPU tensors (a loss to log, a flag) still have a way
        pg._register_backend(torch.device("cpu"), kind, backend)
    return pg


class MeshGroups:
    """Every :class:`RelayGroup` of this process, and their binding per generation.

    One per process: ``torch.distributed`` keeps one world, and the ``torchrelay`` backend
    hands each group it creates to this registry.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.groups: list[RelayGroup] = []
        self.wakeup = Wakeup()
        self.stale: Callable[[], bool] = lambda: False
        self.poisoned: BaseException | None = None
        self.watching = False

    def watch(self, wakeup: Wakeup, stale: Callable[[], bool]) -> None:
        """Wait on collectives as the agent waits on its own: woken by ``wakeup``, left
        when ``stale()`` (a newer generation); failures poison instead of raising."""
        self.wakeup, self.stale, self.watching = wakeup, stale, True
        with self._lock:
            for group in self.groups:
                group.registry = self

    def poison(self, exc: BaseException) -> None:
        """The current generation's collectives failed or were left: skip the rest."""
        if self.poisoned is None:
            self.poisoned = exc

    def create(self, opts: Any, _backend_options: Any = None) -> RelayGroup:
        """The ``torchrelay`` backend's creator (``dist.Backend.register_backend``)."""
        group = RelayGroup(opts.group_rank, opts.group_size, list(opts.global_ranks_in_group))
        with self._lock:
            self.groups.append(group)
            if self.watching:
                group.registry = self
        return group

    def init_default(self, rank: int, world_size: int) -> RelayGroup:
        """Make the job's world ``torch.distributed``'s default group (once).

        Raises:
            RuntimeError: the script already initialised ``torch.distributed`` itself.
        """
        if dist.is_initialized():
            default = dist.distributed_c10d._get_default_group()
            if isinstance(default, RelayGroup):
                return default
            raise RuntimeError(
                "torch.distributed is already initialised with another backend "
                f"({dist.get_backend()}): under torchrelay do not call "
                "dist.init_process_group(); job.device_mesh() sets it up"
            )
        if BACKEND_NAME.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(
                BACKEND_NAME, self.create, extended_api=True, devices=["cpu", "cuda"]
            )
        # The store only serves torch's own bookkeeping: the transports rendezvous on each
        # generation's store when they are bound.
        dist.init_process_group(
            backend=BACKEND_NAME, store=HashStore(), rank=rank, world_size=world_size
        )
        default = dist.distributed_c10d._get_default_group()
        assert isinstance(default, RelayGroup)
        return default

    def rebind(
        self,
        generation: int,
        store: Any,
        make_backend: Callable[[Any, int, int], Any],
        device: torch.device,
    ) -> None:
        """Bind every group to a fresh transport of ``generation``.

        ``store`` is the generation's store; each group rendezvous under its own prefix.
        ``make_backend(store, rank, size)`` builds one gloo/NCCL backend object; with
        gloo's lazy pairs (``TORCH_GLOO_LAZY_INIT``) building it does not wait for peers.
        """
        with self._lock:
            groups = list(self.groups)
        self.poisoned = None  # a new generation: its collectives start afresh
        for group in groups:
            if group.generation == generation:
                continue  # bound already (a second mesh built in the same generation)
            prefixed = PrefixStore(f"mesh/{group.key}", store)
            backend = make_backend(prefixed, group.rank(), group.size())
            group.bind(
                generation, wrap_backend(backend, prefixed, group.rank(), group.size(), device)
            )


MESH_GROUPS = MeshGroups()

__all__ = [
    "BACKEND_NAME",
    "MESH_GROUPS",
    "MeshGroups",
    "RelayGroup",
    "RelayWork",
    "UnboundGroupError",
    "wrap_backend",
]
