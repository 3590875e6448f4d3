"""Which ranks of a sharded job hold the same bits, and how a DTensor travels (design §12).

A mesh dimension is a *replica* dimension when every tracked tensor is the same along it:
HSDP's replicate dimension (FSDP2 gives its DTensors ``Replicate()`` there), the data-parallel
dimension of a tensor-parallel job (its DTensors live on the ``tp`` sub-mesh only). Ranks
that differ only in replica coordinates form a *shard class*: each holds the same local
shards, so a lost rank's state can come from any other member of its class, and the
divergence guard compares ranks within a class. Everything else (a plain tensor, Adam's
``step``) is the same on every rank. What cannot be told (an unnamed sub-mesh) counts as
sharded, so doubt leads to a refusal, never to a wrong shard.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate


def is_dtensor(value: Any) -> bool:
    return isinstance(value, DTensor)


@dataclass(frozen=True)
class ShardSpec:
    """What a DTensor is beyond its local shard: rebuilt on the receiver's own mesh."""

    mesh_dim_names: tuple[str, ...] | None
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def spec_of(value: DTensor) -> ShardSpec:
    names = value.device_mesh.mesh_dim_names
    return ShardSpec(
        tuple(names) if names is not None else None,
        tuple(value.placements),
        tuple(value.shape),
        tuple(value.stride()),
    )


def rebuild(spec: ShardSpec, local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """The DTensor of ``local`` on ``mesh`` (no collective: the spec is the sender's)."""
    return DTensor.from_local(
        local,
        find_mesh(mesh, spec.mesh_dim_names),
        spec.placements,
        run_check=False,
        shape=torch.Size(spec.shape),
        stride=spec.stride,
    )


def find_mesh(root: DeviceMesh, names: tuple[str, ...] | None) -> DeviceMesh:
    """The root mesh or its sub-mesh of ``names``.

    Raises:
        ValueError: no such sub-mesh (the sender built another mesh).
    """
    root_names = root.mesh_dim_names
    if names is None or (root_names is not None and tuple(root_names) == names):
        return root
    try:
        return root[names]
    except (KeyError, RuntimeError, ValueError) as exc:
        raise ValueError(
            f"the recovery source sent a DTensor on mesh dimensions {names}, which this "
            f"process's mesh {root_names} does not have: build the same mesh on every rank"
        ) from exc


def replica_mask(values: Iterable[Any], root: DeviceMesh) -> int:
    """Bit ``d`` set when every tensor in ``values`` (a state's leaves) is the same along
    mesh dimension ``d``."""
    root_names = root.mesh_dim_names
    mask = (1 << root.ndim) - 1
    for t in values:
        if not isinstance(t, DTensor):
            continue
        names = t.device_mesh.mesh_dim_names
        if names is None or root_names is None:
            # Unnamed: only the root mesh itself can be matched dimension by dimension.
            if t.device_mesh is not root and t.device_mesh != root:
                return 0
            dims = list(range(root.ndim))
        else:
            try:
                dims = [list(root_names).index(n) for n in names]
            except ValueError:
                return 0  # a mesh that is not (a slice of) the job's: assume no replica
        for dim, placement in zip(dims, t.placements, strict=True):
            if not isinstance(placement, Replicate):
                mask &= ~(1 << dim)
    return mask


def shard_classes(layout: torch.Tensor, mask: int) -> list[int]:
    """The shard class of each rank of a mesh whose ``layout`` (``DeviceMesh.mesh``) holds
    the rank at each coordinate: ranks equal in every non-replica coordinate share one,
    named by the lowest rank in it."""
    first: dict[tuple[int, ...], int] = {}
    found: dict[int, tuple[int, ...]] = {}
    for coords in itertools.product(*(range(d) for d in layout.shape)):
        key = tuple(c for dim, c in enumerate(coords) if not mask & (1 << dim))
        found[int(layout[coords].item())] = key
    for rank in sorted(found):
        first.setdefault(found[rank], rank)
    return [first[found[rank]] for rank in sorted(found)]


@dataclass(frozen=True)
class ShardPlan:
    """Who sends each rank that lacks the committed state its shard, and who cannot get one."""

    sources: dict[int, int]
    unrestorable: list[int]


def shard_sources(steps: Sequence[int], classes: Sequence[int]) -> ShardPlan:
    """Each rank below the highest committed step receives from the lowest holder of that
    step in its shard class; a rank whose class holds no such state is unrestorable."""
    best = max(steps)
    sources: dict[int, int] = {}
    lost: list[int] = []
    for rank, step in enumerate(steps):
        if step == best:
            continue
        holders = [r for r, s in enumerate(steps) if s == best and classes[r] == classes[rank]]
        if holders:
            sources[rank] = holders[0]
        else:
            lost.append(rank)
    return ShardPlan(sources, lost)


__all__ = [
    "ShardPlan",
    "ShardSpec",
    "find_mesh",
    "is_dtensor",
    "rebuild",
    "replica_mask",
    "shard_classes",
    "shard_sources",
    "spec_of",
]
