"""What a training process is in its job: identity, connections and the state every part
of :class:`~torchrelay.agent.Job` shares (set up here, before any of it runs)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from torch._C._distributed_c10d import TCPStore
from torch.distributed.device_mesh import DeviceMesh

from torchrelay import deathlatch
from torchrelay.agent._buddy import WardCopy
from torchrelay.agent._chaos import ENV as CHAOS_ENV
from torchrelay.agent._chaos import ChaosPoint
from torchrelay.agent._checkpoint import CheckpointWrite, checkpoint_settings
from torchrelay.agent._config import bucket_bytes_setting, env, nats_url, verify_every_setting
from torchrelay.agent._errors import AgentError
from torchrelay.agent._feed import Feed
from torchrelay.agent._group import Backend, Wakeup
from torchrelay.agent._net import NetThread
from torchrelay.agent._reducer import Reducer
from torchrelay.agent._state import OutsideState, PendingState, Snapshot, Stateful
from torchrelay.contract import Generation, Role


class Member:
    """The state shared by the agent's parts; :class:`~torchrelay.agent.Job` builds on it."""

    def __init__(
        self,
        *,
        collective_timeout_s: float | None = None,
        connect_timeout_s: float = 30.0,
        verify_every: int | None = None,
        overlap: bool | None = None,
        bucket_mb: float | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        checkpoint_keep: int | None = None,
        checkpoint_every_s: float | None = None,
    ) -> None:
        self.verify_every = verify_every_setting(verify_every)
        self.checkpoints = checkpoint_settings(
            checkpoint_dir, checkpoint_every, checkpoint_keep, checkpoint_every_s
        )
        # Pure FSDP's buddy copies (docs/design.md §12); off (the bench's baseline), a lost
        # rank whose shard no other rank holds goes to the job's fallback.
        self.buddy_copies = os.environ.get("TORCHRELAY_BUDDY_COPIES", "1") != "0"
        bucket_bytes = bucket_bytes_setting(overlap, bucket_mb)
        # First: from here on, the launcher learns of this process's death as it begins.
        deathlatch.hold_from_env()
        self.job_id = env("TORCHRELAY_JOB_ID")
        self.member_id = env("TORCHRELAY_MEMBER_ID", f"{self.job_id}-pid{os.getpid()}")
        self.role = Role(env("TORCHRELAY_ROLE", "worker"))
        self.node = env("TORCHRELAY_NODE", "local-0")
        self.gpu = int(env("TORCHRELAY_GPU", "0"))
        self.cluster = env("TORCHRELAY_CLUSTER", "local")
        self.tenant = env("TORCHRELAY_TENANT", "default")
        self.run_dir = Path(env("TORCHRELAY_RUN_DIR", "."))
        try:
            self._chaos = ChaosPoint(os.environ.get(CHAOS_ENV), self.member_id)
        except ValueError as exc:
            raise AgentError(str(exc)) from None
        timeout_s = collective_timeout_s or float(
            os.environ.get("TORCHRELAY_COLLECTIVE_TIMEOUT_S", "60")
        )
        host = os.environ.get("TORCHRELAY_ADVERTISE_HOST", "127.0.0.1")
        self.backend = Backend.detect(self.gpu, timeout_s, host)
        self.overlap = bucket_bytes is not None

        self._lock = threading.Lock()
        self._wakeup = Wakeup()
        self._latest: Generation | None = None  # newest generation seen (net thread writes)
        self._latest_immediate = 0  # newest generation number with mode immediate
        self._ever_named = False
        self._leaving_at_boundary = False
        self._named_t: float | None = None
        self._exiting = False

        self._gen: Generation | None = None  # the generation the training thread runs in
        self._pg: Any = None
        self._rank: int | None = None
        self._tracked: dict[str, Stateful] = {}
        self._has_state = self.role == Role.WORKER
        self._committed = -1
        self._regroup = True
        self._in_step: int | None = None
        self._step_called = False
        self._last_commit_t: float | None = None
        self._disrupted_t: float | None = None  # when this rank first learnt of the change
        self._lost_steps = 0
        self._resume: dict[str, Any] | None = None
        # What a step that did not commit may have changed outside the agent (a scheduler
        # stepped whatever job.step() returned): put back before the step is yielded again.
        self._rollback: OutsideState | None = None
        self._pending: PendingState | None = None  # state of the last sync still arriving
        self._reducer = Reducer(self.backend.device, bucket_bytes)
        self._feed: Feed | None = None
        self._positions: list[bytes] | None = None  # the step's exchanged loader positions
        # A committed step whose optimizer step the loop still runs (reduce_gradients):
        # the divergence guard and a boundary switch wait for it.
        self._after: tuple[Generation, int, bool] | None = None
        self._last_step_hb = 0.0
        self._step_time: float | None = None
        self._step_started: float | None = None
        self._finished = False
        # A job whose model is sharded over job.device_mesh() (docs/design.md §12).
        self._sharded = False
        self._mesh: DeviceMesh | None = None  # job.device_mesh's (sharded jobs)
        # A sharded step between reduce_gradients and its commit, and the state it began at.
        self._uncommitted: tuple[Generation, int, list[Any]] | None = None
        self._snapshot: Snapshot | None = None
        self._classes: list[int] | None = None  # each rank's shard class, this generation
        self._ward: WardCopy | None = None  # the buddy copy held, of the committed step
        self._ward_spare: WardCopy | None = None  # older buffers the next copy may reuse
        # Checkpoints (docs/design.md §13): the steps of the last one considered (taken, or
        # skipped because a generation began there), the writes still in flight.
        self._checkpoint_last = 0
        self._checkpoint_clock = time.monotonic()  # when this rank last checkpointed
        self._checkpoint_writes: list[CheckpointWrite] = []
        self._checkpoint_loaded = False
        self._exit_status = 0
        # Where to append this member's recovery timeline (wall-clock phases), if anywhere.
        timeline = os.environ.get("TORCHRELAY_AGENT_TIMELINE")
        self._timeline = Path(timeline) / f"{self.member_id}.timeline" if timeline else None

        # The rendezvous store every member hosts; a generation names whose one is used.
        self._store = TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=self.backend.timeout
        )
        self.store_addr = f"{host}:{self._store.port}"

        self._net = NetThread(
            nats_url(),
            f"agent-{self.member_id}",
            os.environ.get("TORCHRELAY_NATS_CREDENTIALS") or None,
            connect_timeout_s,
        )

    def _current_rank(self) -> int:
        """This process's rank in its current generation (or the one that named it)."""
        if self._rank is not None:
            return self._rank
        with self._lock:
            latest = self._latest
        rank = latest.member_rank(self.member_id) if latest is not None else None
        if rank is None:
            raise AgentError("this process holds no rank yet")
        return rank

    def _generation_number(self) -> int:
        """The generation this process trains in (0 before it holds a rank)."""
        return self._gen.generation if self._gen is not None else 0
