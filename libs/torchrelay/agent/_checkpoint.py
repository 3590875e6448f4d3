"""Checkpoints of the tracked state through ``torch.distributed.checkpoint`` (docs/design.md §13).

The fallback when a rank cannot be migrated live: the job restarts from the newest complete
checkpoint (``checkpoint_restart``). A checkpoint is DCP's format, so it loads at another
world size (DCP reshards DTensors), with a manifest of torchrelay's beside it.

Writing one, on every rank, at a step boundary that every rank of the generation reached:

1. The training thread copies the tracked state (a DTensor's local shard) to host memory
   and builds its DCP save plan; the ranks exchange their plans in one all-gather over the
   generation's group, and each computes the same global plan (deduplicated: a replicated
   tensor is written by one rank).
2. A background thread writes the rank's part (``__R_0.distcp``, fsynced) and then
   ``__R.ATTEMPT.results``: DCP's write results and the sha256 of each file it wrote
   (``ATTEMPT`` names the generation: an earlier attempt's parts are never mixed in).
3. The coordinator (rank 0) waits for every rank's results, writes DCP's ``.metadata`` and
   then the manifest ``torchrelay.json``, atomically: a checkpoint without a manifest is
   incomplete and never loaded. It then removes checkpoints beyond ``keep``.

No collective runs outside the training thread, so a checkpoint in flight never interleaves
with a step's collectives; a rank lost during a write leaves that checkpoint incomplete.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import pickle
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.tensor import DTensor

from torchrelay.agent._errors import AgentError
from torchrelay.agent._state import Stateful
from torchrelay.checkpoints import (
    FORMAT,
    MANIFEST,
    STEP_DIR,
    CheckpointError,
    Found,
    complete_checkpoints,
    sha256_of,
    step_dir,
    verify_files,
)

log = logging.getLogger("torchrelay.agent")

DEFAULT_KEEP = 2
# How long the coordinator waits for every rank's part before the checkpoint is given up.
PARTS_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class CheckpointSettings:
    """Where and how often the agent checkpoints (``init(checkpoint_dir=...)`` or the
    ``TORCHRELAY_CHECKPOINT_*`` environment the launcher sets from ``--checkpoint-*``)."""

    directory: Path
    every: int | None  # steps between checkpoints (None: by time only)
    keep: int = DEFAULT_KEEP
    every_s: float | None = None  # seconds between checkpoints, on rank 0's clock


def _whole(name: str, raw: Any, least: int) -> int:
    if isinstance(raw, str):
        try:
            raw = int(raw.strip())
        except ValueError:
            raise AgentError(f"{name}={raw!r} is not a whole number") from None
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < least:
        raise AgentError(f"{name}={raw!r}: give a whole number >= {least}")
    return raw


def _seconds(name: str, raw: Any) -> float:
    if isinstance(raw, str):
        try:
            raw = float(raw.strip())
        except ValueError:
            raise AgentError(f"{name}={raw!r} is not a number of seconds") from None
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not 0 < raw < 1e9:
        raise AgentError(f"{name}={raw!r}: give a number of seconds > 0")
    return float(raw)


def checkpoint_settings(
    directory: str | os.PathLike[str] | None,
    every: int | None,
    keep: int | None,
    every_s: float | None = None,
) -> CheckpointSettings | None:
    """The settings from the arguments, else the environment; None: no checkpoints.

    Raises:
        AgentError: a setting that is not usable, named.
    """
    raw_dir = directory if directory is not None else os.environ.get("TORCHRELAY_CHECKPOINT_DIR")
    if raw_dir is None or str(raw_dir).strip() == "":
        if every is not None or every_s is not None:
            raise AgentError("checkpoint_every needs checkpoint_dir (where to write them)")
        return None
    raw_every = every if every is not None else os.environ.get("TORCHRELAY_CHECKPOINT_EVERY")
    raw_s = every_s if every_s is not None else os.environ.get("TORCHRELAY_CHECKPOINT_EVERY_S")
    if raw_every is None and raw_s is None:
        raise AgentError(
            f"checkpoint_dir={str(raw_dir)!r} needs checkpoint_every (steps between "
            "checkpoints) or checkpoint_every_s (seconds), or TORCHRELAY_CHECKPOINT_EVERY(_S)"
        )
    raw_keep = keep if keep is not None else os.environ.get("TORCHRELAY_CHECKPOINT_KEEP")
    return CheckpointSettings(
        directory=Path(raw_dir),
        every=None if raw_every is None else _whole("checkpoint_every", raw_every, 1),
        keep=DEFAULT_KEEP if raw_keep is None else _whole("checkpoint_keep", raw_keep, 1),
        every_s=None if raw_s is None else _seconds("checkpoint_every_s", raw_s),
    )


# --------------------------------------------------------------------------- writing


def _host_copy(value: Any) -> Any:
    """A copy of a state dict that the training loop cannot change under the writer."""
    if isinstance(value, DTensor):
        local = value.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(
            local,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_host_copy(v) for v in value)
    return copy.deepcopy(value)


def stage(tracked: Mapping[str, Stateful], steps: int) -> dict[str, Any]:
    """The checkpoint's state dict: a host copy of every tracked state after ``steps`` steps."""
    return {"steps": steps, "state": {n: _host_copy(o.state_dict()) for n, o in tracked.items()}}


class CheckpointWrite:
    """One rank's part of one checkpoint (see the module's docstring for the steps)."""

    def __init__(
        self,
        root: Path,
        staged: dict[str, Any],
        rank: int,
        world_size: int,
        settings: CheckpointSettings,
        attempt: str = "g0",
    ) -> None:
        self.steps = int(staged["steps"])
        self.path = step_dir(root, self.steps)
        self.root, self.rank, self.world_size = root, rank, world_size
        self.keep = settings.keep
        self.attempt = attempt
        self.path.mkdir(parents=True, exist_ok=True)
        self._writer = FileSystemWriter(self.path)
        self._planner = DefaultSavePlanner()
        self._planner.set_up_planner(
            state_dict=staged, storage_meta=self._writer.storage_meta(), is_coordinator=rank == 0
        )
        self._writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def _part(self, rank: int) -> Path:
        return self.path / f"__{rank}.{self.attempt}.results"

    def local_plan(self) -> bytes:
        """This rank's save plan, for the all-gather."""
        plan = self._writer.prepare_local_plan(self._planner.create_local_plan())
        return pickle.dumps(plan)

    def start(self, plans: list[bytes], given_up: Callable[[], bool]) -> None:
        """Write this rank's part in the background from every rank's plan."""
        self._thread = threading.Thread(
            target=self._run,
            # The job's own ranks' plans (DCP's .metadata is a pickle too).
            args=([pickle.loads(p) for p in plans], given_up),  # noqa: S301
            name=f"torchrelay-checkpoint-{self.steps}",
            daemon=True,
        )
        self._thread.start()

    def wait(self, timeout_s: float) -> bool:
        """Whether this rank's part (and on the coordinator, the manifest) got written."""
        return self.done.wait(timeout_s) and self.error is None

    def _run(self, plans: list[Any], given_up: Callable[[], bool]) -> None:
        _background_priority()
        try:
            global_plans, metadata = DefaultSavePlanner().create_global_plan(plans)
            global_plans = self._writer.prepare_global_plan(global_plans)
            final = self._planner.finish_plan(global_plans[self.rank])
            writes = self._writer.write_data(final, self._planner)
            writes.wait()
            results = writes.value()
            files = {
                name: sha256_of(self.path / name)
                for name in sorted({r.storage_data.relative_path for r in results})
            }
            _atomic_write(self._part(self.rank), pickle.dumps((results, files)))
            if self.rank == 0:
                self._finish(metadata, given_up)
        except BaseException as exc:  # a failed checkpoint must not end the job
            self.error = exc
            log.warning("torchrelay: checkpoint %s not written: %r", self.path, exc)
        finally:
            self.done.set()

    def _finish(self, metadata: Any, given_up: Callable[[], bool]) -> None:
        """Coordinator: every rank's part is there -> ``.metadata``, the manifest, pruning."""
        parts = [self._part(r) for r in range(self.world_size)]
        deadline = time.monotonic() + PARTS_TIMEOUT_S
        while not all(p.exists() for p in parts):
            if given_up() or time.monotonic() > deadline:
                missing = [p.name for p in parts if not p.exists()]
                raise CheckpointError(f"{self.path}: no part from {', '.join(missing)}")
            time.sleep(0.02)
        results, files = [], {}
        for part in parts:
            rank_results, rank_files = pickle.loads(part.read_bytes())  # noqa: S301 - our own part
            results.append(rank_results)
            files.update(rank_files)
        self._writer.finish(metadata=metadata, results=results)
        files[".metadata"] = sha256_of(self.path / ".metadata")
        manifest = {
            "format": FORMAT,
            "steps": self.steps,
            "world_size": self.world_size,
            "files": files,
            "written_at": time.time(),
        }
        _atomic_write(self.path / MANIFEST, json.dumps(manifest, indent=1).encode())
        prune(self.root, self.keep)


def _background_priority() -> None:
    """Run this thread at the lowest CPU priority: on a host whose cores the ranks keep
    busy, the write takes what the training threads leave (Linux nices threads one by one)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(path)


def prune(root: Path, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints; remove older ones, and incomplete
    ones older than the newest complete one (a write a failure cut short)."""
    complete = complete_checkpoints(root)
    if not complete:
        return
    kept = {f.steps for f in complete[:keep]}
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            match = STEP_DIR.match(entry.name)
            if match and int(match[1]) < complete[0].steps and int(match[1]) not in kept:
                shutil.rmtree(entry, ignore_errors=True)


# --------------------------------------------------------------------------- loading


def _load_target(found: Found, tracked: Mapping[str, Stateful]) -> tuple[dict[str, Any], Any]:
    """A flat DCP load target: the live DTensors (DCP reshards into them), fresh tensors of
    the saved shape for everything else, and the mappings that unflatten it."""
    for obj in tracked.values():
        if isinstance(obj, torch.optim.Optimizer):
            _init_optim_state(obj)  # its state's DTensors are then the right shards
    live, _ = flatten_state_dict({"state": {n: o.state_dict() for n, o in tracked.items()}})
    metadata = FileSystemReader(found.path).read_metadata()
    target: dict[str, Any] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            target[fqn] = None  # a pickled leaf: DCP puts the object in its place
        elif isinstance(meta, TensorStorageMetadata):
            current = live.get(fqn)
            if isinstance(current, DTensor) and tuple(current.shape) == tuple(meta.size):
                target[fqn] = current
            else:
                target[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return target, metadata.planner_data


def load_checkpoint(found: Found, tracked: Mapping[str, Stateful]) -> int:
    """Load ``found`` into the tracked objects; returns the number of steps it holds.

    Raises:
        CheckpointError: a file fails its sha256, or the checkpoint's names are not the
            tracked ones.
    """
    verify_files(found)
    target, mappings = _load_target(found, tracked)
    with warnings.catch_warnings():
        # Each rank reads what its shards need on its own, with no collective: DCP's
        # "assuming the intent is to load in a single process" is the intent.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(target, checkpoint_id=found.path, planner=DefaultLoadPlanner(), no_dist=True)
    state = unflatten_state_dict(target, mappings)
    saved = state.get("state", {})
    if set(saved) != set(tracked):
        raise CheckpointError(
            f"{found.path} holds {sorted(saved)} but the job tracks {sorted(tracked)}"
        )
    for name, obj in tracked.items():
        obj.load_state_dict(_with_live_keys(saved[name], obj.state_dict()))
    return int(state["steps"])


def _with_live_keys(loaded: Any, live: Any) -> Any:
    """DCP's paths turn every key into a string (an optimizer's state is keyed by parameter
    index): give each loaded key back the type the live state dict's same key has."""
    if not isinstance(loaded, Mapping):
        return loaded
    live_keys = {str(k): k for k in live} if isinstance(live, Mapping) else {}
    out = {}
    for key, value in loaded.items():
        original = live_keys.get(str(key), key)
        sub = live.get(original) if isinstance(live, Mapping) else None
        out[original] = _with_live_keys(value, sub)
    return out


def newest_loadable(root: Path, tracked: Mapping[str, Stateful]) -> tuple[Found | None, int]:
    """Load the newest complete checkpoint that passes its checks, refusing corrupted ones
    with a warning naming the file; returns it (None: none) and its number of steps."""
    for found in complete_checkpoints(root):
        try:
            return found, load_checkpoint(found, tracked)
        except CheckpointError as exc:
            print(f"torchrelay: checkpoint refused: {exc}; trying an older one", file=sys.stderr)
    return None, 0
