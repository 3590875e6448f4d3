"""What a launcher needs before it starts anything: the environment, credentials, slots and
the meaning of an exit code."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import re
import signal
import stat
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torchrelay.bus import Bus, NoResponder, RpcFailed
from torchrelay.contract import (
    EXIT_APPLICATION_ERROR,
    EXIT_FENCED,
    EXIT_OK,
    JobPolicy,
    Role,
    SpareSlot,
    Subjects,
)
from torchrelay.deathlatch import DeathLatch

EXIT_USAGE = 2
# The control plane refused this host (a second launcher on it, a late host, a node rank
# held, another shape or claim): another try as the same host cannot succeed.
EXIT_HOST_REFUSED = 3
Outcome = Literal["succeeded", "failed", "cancelled"]
GIVE_UP_MARGIN_S = 30.0  # docs/design.md §3: a lost rank not replaced in wait_timeout + 30 s
STOP_GRACE_S = 10.0
REGISTER_CONFLICT_RETRY_S = 30.0  # how long a spare's slot may still be another job's
REGISTER_CONFLICT_PAUSE_S = 0.5
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-]")


# Environment every worker and spare gets unless the user set the variable (to anything).
# THP_MEM_ALLOC_ENABLE=1: torch puts CPU allocations of 2 MB and more on transparent huge
# pages. A SIGKILLed rank is seen dead (by waitpid here, by its peers' sockets) only once
# the kernel has unmapped its memory: a process holding 400 MB of tensors took 69-80 ms to
# die here with 4 KB pages, 31-42 ms with huge pages; first touches of a fresh state buffer
# (28.5 MB) took 7-12 ms instead of 18-22 ms.
PROCESS_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1"}


# What the stack's own processes are told and a training process is not: where the stack's
# state and secrets are, tokens, Redis, and credentials other than the job's own (the job's
# claim too: with it a process could mint the job's credentials).
STACK_ONLY_ENV = frozenset(
    {
        "TORCHRELAY_HOME",
        "TORCHRELAY_JOB_CLAIM",
        "TORCHRELAY_AUTH_DIR",
        "TORCHRELAY_AUTH_ISSUER_SEED_FILE",
        "TORCHRELAY_NATS_REVOKER_CREDENTIALS",
        "TORCHRELAY_NODE_AGENT_CREDENTIALS",
        "TORCHRELAY_NATS_CREDENTIALS",
        "TORCHRELAY_OPERATOR_TOKEN",
        "TORCHRELAY_TOKEN",
        "REDIS_URL",
        "REDIS_PASSWORD",
    }
)


def run_as_ids(user: str) -> tuple[int, int]:
    """The uid and gid ``--run-as USER`` names.

    Raises:
        LauncherError: not started as root, or no such user.
    """
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise LauncherError(f"--run-as {user}: no such user") from None
    if os.geteuid() != 0:
        raise LauncherError(f"--run-as {user} needs torchrelay run to be started as root")
    if entry.pw_uid == 0:
        raise LauncherError(f"--run-as {user}: the training code must not run as root")
    return entry.pw_uid, entry.pw_gid


def prepare_run_dir(run_dir: Path, run_as: tuple[int, int] | None) -> None:
    """Create the job's run dir 0700; under ``--run-as`` owned by the training user.

    Root then works in a shared temporary directory, so nothing there may be a link or
    belong to someone else (a planted symlink would have root chown its target).

    Raises:
        LauncherError: the run dir or its parent is a link or not root's.
    """
    if run_as is not None:
        base = run_dir.parent
        base.mkdir(mode=0o711, parents=True, exist_ok=True)
        st = os.lstat(base)
        if stat.S_ISLNK(st.st_mode) or st.st_uid != 0:
            raise LauncherError(f"{base} must be a directory of root's, not a link")
        if run_dir.is_symlink():
            raise LauncherError(f"{run_dir} is a symbolic link; remove it")
    run_dir.mkdir(parents=True, exist_ok=True)
    st = os.lstat(run_dir)
    if run_as is not None and st.st_uid not in (0, run_as[0]):
        raise LauncherError(f"{run_dir} belongs to uid {st.st_uid}; remove it")
    os.chmod(run_dir, 0o700)
    if run_as is not None:
        # The training processes own their run dir (exit records) and nothing else.
        os.chown(run_dir, *run_as, follow_symlinks=False)


def with_process_defaults(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`PROCESS_DEFAULTS` added where it does not set them."""
    return {**PROCESS_DEFAULTS, **env}


async def register_hot_spare(
    bus: Bus, slot: SpareSlot, retry_s: float = REGISTER_CONFLICT_RETRY_S
) -> str | None:
    """Register ``slot`` with the spare pool; None when it took it, else why not.

    The slot's last job may have finished a moment ago: the pool lets its hot spares go when
    it handles that JobFinished, which can come after this request (back-to-back jobs on one
    host). A conflict is asked again for up to ``retry_s`` seconds.
    """
    deadline = time.monotonic() + retry_s
    while True:
        try:
            await bus.request(Subjects.rpc("spare_pool", "register"), slot, timeout=2.0)
        except NoResponder:
            return (
                f"no spare pool answered; {slot.member_id} is not registered as a hot spare "
                "(is the control plane running?)"
            )
        except RpcFailed as exc:
            if exc.error.code == "conflict" and time.monotonic() < deadline:
                await asyncio.sleep(REGISTER_CONFLICT_PAUSE_S)
                continue
            return f"spare pool refused {slot.member_id}: {exc}"
        return None


class LauncherError(RuntimeError):
    """The job cannot be launched; the message says what to do."""


class HostRefused(LauncherError):
    """The job's rendezvous refused this host; the message names why."""


# --------------------------------------------------------------------------- pure rules


def resolve_nats_url(environ: dict[str, str] | None = None) -> str:
    """``NATS_URL``, else ``nats_url`` of ``<TORCHRELAY_HOME or ./.torchrelay>/stack.json``.

    Raises:
        LauncherError: neither is available.
    """
    env = os.environ if environ is None else environ
    url = env.get("NATS_URL")
    if url:
        return url
    stack = _stack_info(env)
    if stack is None or not stack.get("nats_url"):
        raise LauncherError("no torchrelay stack: run `torchrelay up --detach` or set NATS_URL")
    return str(stack["nats_url"])


def _stack_info(env: Mapping[str, str]) -> dict[str, Any] | None:
    """``stack.json`` of ``<TORCHRELAY_HOME or ./.torchrelay>``, or None if absent/unreadable."""
    path = Path(env.get("TORCHRELAY_HOME", ".torchrelay")) / "stack.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def resolve_credentials(role: str, environ: dict[str, str] | None = None) -> str | None:
    """The NATS credential file of ``role``: ``TORCHRELAY_NATS_CREDENTIALS``, else the one
    ``stack.json`` of ``<TORCHRELAY_HOME or ./.torchrelay>`` names for the role, else None
    (an open server)."""
    env = os.environ if environ is None else environ
    given = env.get("TORCHRELAY_NATS_CREDENTIALS")
    if given:
        return given
    data = _stack_info(env)
    if data is None:
        return None
    creds = data.get("credentials") or {}
    path = creds.get(role) if isinstance(creds, dict) else None
    if not path:
        return None
    if env.get("NATS_URL") and env.get("NATS_URL") != data.get("nats_url"):
        return None  # another server than the stack's
    return str(path)


def slot_of(index: int, nodes: int, cluster: str) -> tuple[str, int]:
    """The simulated (node, gpu) of the ``index``-th process: round-robin over the nodes."""
    return f"{cluster}-{index % nodes}", index // nodes


def classify_exit(code: int, record: dict[str, Any] | None) -> str:
    """What a child's exit means: ``finished``, ``fenced``, ``application_error`` or ``lost``.

    Exit 1 counts as an application error only with the agent's exit record; any other
    code, or a signal (negative code), means the worker was lost -- unless the agent's
    record says it had finished training (``job.finish()`` ran): a process that dies on its
    way out after the last step lost nothing.
    """
    if code == EXIT_OK or (record is not None and record.get("kind") == "finished"):
        return "finished"
    if code == EXIT_FENCED:
        return "fenced"
    if (
        code == EXIT_APPLICATION_ERROR
        and record is not None
        and record.get("kind") == "application_error"
    ):
        return "application_error"
    return "lost"


def describe_exit(code: int) -> str:
    """``exit code 3`` or ``killed by SIGKILL``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# --------------------------------------------------------------------------- processes


@dataclass
class Child:
    """One process of the job."""

    member_id: str
    role: Role
    node: str
    gpu: int
    proc: asyncio.subprocess.Process | None = None
    exit_code: int | None = None
    outcome: str | None = None
    stopping: bool = False  # the launcher itself is stopping it: not a failure
    fenced: bool = False  # killed on the control plane's fence order: another holds its rank
    lost_at: float | None = None
    latch: DeathLatch | None = None
    reported_lost: bool = False  # its loss was reported while it was still dying
    local_rank: int = 0  # its slot's place on this host (torchrun's LOCAL_RANK)
    rank: int | None = None  # the rank it starts with (None: a spare, until it takes one)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.exit_code is None


@dataclass
class HostPlan:
    """What ``--nnodes/--node-rank/--nproc-per-node`` (or ``--spare``) asked of this host."""

    node: str  # the host's name: the node the detector's node agent reports
    nproc_per_node: int
    gpus: list[int]  # the device of each slot on this host, workers first, then spares
    nnodes: int = 1
    node_rank: int | None = None  # None: the rendezvous gives the lowest free one
    spare_host: bool = False
    simulate_gpus: bool = False
    claim: str | None = None  # shared by every launcher of the job (TORCHRELAY_JOB_CLAIM)
    advertise_host: str | None = None  # where this host's ranks are reached by the others
    instance: str = ""

    def __post_init__(self) -> None:
        if not self.instance:
            self.instance = uuid.uuid4().hex[:16]

    @property
    def token(self) -> str:
        """The host's name as it may appear in member ids and credential seats."""
        return _UNSAFE.sub("-", self.node)[:48] or "host"

    def seat(self) -> str:
        """This host's credential seat: ``h<node rank>``, or ``spare-<host>``."""
        if self.spare_host or self.node_rank is None:
            return f"spare-{self.token}"
        return f"h{self.node_rank}"


@dataclass
class Options:
    """What ``torchrelay run`` was asked to do."""

    nproc: int
    spares: int
    job_id: str
    tenant: str
    nodes: int
    policy: JobPolicy
    wait_timeout_s: float
    allow_shrink: bool
    script: str
    script_args: list[str]
    nats_url: str
    cluster: str
    run_dir: Path
    credentials: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    node_agents: bool = True
    node_agent_credentials: str | None = None
    # --run-as: the training processes' uid and gid (the launcher runs as root).
    run_as: tuple[int, int] | None = None
    # --python: the training processes' interpreter (the launcher's by default).
    python: str = sys.executable
    # -m: ``script`` is a module name, run as ``python -m script`` (torchrun's -m).
    module: bool = False
    # One host of a job across hosts (--nnodes/--node-rank/--nproc-per-node, or --spare);
    # None: the one-host shortcut (--nproc/--spares/--nodes on simulated slots).
    host: HostPlan | None = None
    # --checkpoint-dir: the checkpoint_restart policy restarts the job from it, at most
    # max_restarts times (docs/design.md §13).
    checkpoint_dir: Path | None = None
    max_restarts: int = 3

    @property
    def checkpoint_every(self) -> int | None:
        """Steps between the job's checkpoints (``--checkpoint-every``); None without them."""
        raw = self.extra_env.get("TORCHRELAY_CHECKPOINT_EVERY", "")
        return int(raw) if raw.isdigit() and int(raw) >= 1 else None
