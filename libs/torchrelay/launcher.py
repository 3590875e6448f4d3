"""``torchrelay run``: start a job's workers and hot spares on simulated slots and supervise them.

The launcher is the job's hands on this machine: it spawns N workers
and S hot spares as subprocesses (``--nodes K`` spreads them over K simulated nodes),
registers the job and its spares, reports every child's exit (a lost rank's as soon as it
starts dying: ``deathlatch``), answers fencing orders, cold-spare spawns and pid look-ups on
NATS, forwards Ctrl-C/SIGTERM to the whole job, and exits 0 when every rank of the newest
generation has finished.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nats.aio.msg import Msg
from pydantic import ValidationError

from torchrelay.bus import Bus, BusError, NoResponder, RpcFailed, validation_message
from torchrelay.contract import (
    EXIT_APPLICATION_ERROR,
    EXIT_FENCED,
    EXIT_OK,
    AgentReport,
    FenceOrder,
    Generation,
    JobCredentials,
    JobCredentialsRequest,
    JobCredentialsRevoke,
    JobFinished,
    JobPolicy,
    JobRegistered,
    Member,
    MigrationFailed,
    ReportKind,
    Role,
    RpcError,
    RpcReply,
    SpareSlot,
    SpareState,
    Subjects,
    make_event_id,
)
from torchrelay.deathlatch import DeathLatch

EXIT_USAGE = 2
Outcome = Literal["succeeded", "failed", "cancelled"]
_TOKEN = re.compile(r"^[A-Za-z0-9_\-]{1,100}$")
GIVE_UP_MARGIN_S = 30.0  # protocol §11: a lost rank not replaced in wait_timeout + 30 s
STOP_GRACE_S = 10.0
REGISTER_CONFLICT_RETRY_S = 30.0  # how long a spare's slot may still be another job's
REGISTER_CONFLICT_PAUSE_S = 0.5


# Environment every worker and spare gets unless the user set the variable (to anything).
# THP_MEM_ALLOC_ENABLE=1: torch puts CPU allocations of 2 MB and more on transparent huge
# pages. A SIGKILLed rank is seen dead (by waitpid here, by its peers' sockets) only once
# the kernel has unmapped its memory: a process holding 400 MB of tensors took 69-80 ms to
# die here with 4 KB pages, 31-42 ms with huge pages; first touches of a fresh state buffer
# (28.5 MB) took 7-12 ms instead of 18-22 ms.
PROCESS_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1"}


# What the stack's own processes are told and a training process is not: where the stack's
# state and secrets are, tokens, Redis, and credentials other than the job's own.
STACK_ONLY_ENV = frozenset(
    {
        "TORCHRELAY_HOME",
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
    lost_at: float | None = None
    latch: DeathLatch | None = None
    reported_lost: bool = False  # its loss was reported while it was still dying

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.exit_code is None


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


class Launcher:
    """Runs one job to its end; :meth:`run` returns the launcher's exit code."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.launcher_id = f"{opts.job_id}-launcher"
        self.children: dict[str, Child] = {}
        self._next_spare = 0
        self._bus: Bus | None = None
        self._changed = asyncio.Event()
        self._interrupted: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Any] = []
        self._gave_up: str | None = None  # the control plane's verdict: no live migration
        self._last_gen: Generation | None = None  # the newest generation read so far
        self._node_agents: list[asyncio.subprocess.Process] = []
        # The job-scoped credential the children connect with (None on an open server).
        self.job_credentials: Path | None = None
        # Binds the job's credential to this launcher: only it may mint or revoke it.
        self._claim = secrets.token_urlsafe(32)

    @property
    def bus(self) -> Bus:
        assert self._bus is not None
        return self._bus

    # ----------------------------------------------------------------- spawning

    def _env(self, child: Child) -> dict[str, str]:
        # The customer's code gets its job credential and nothing of the stack's.
        env = {k: v for k, v in os.environ.items() if k not in STACK_ONLY_ENV}
        env.update(self.opts.extra_env)
        env = with_process_defaults(env)
        env.update(
            {
                "TORCHRELAY_JOB_ID": self.opts.job_id,
                "TORCHRELAY_ROLE": child.role.value,
                "TORCHRELAY_TENANT": self.opts.tenant,
                "TORCHRELAY_NODE": child.node,
                "TORCHRELAY_GPU": str(child.gpu),
                "TORCHRELAY_MEMBER_ID": child.member_id,
                "TORCHRELAY_CLUSTER": self.opts.cluster,
                "TORCHRELAY_RUN_DIR": str(self.opts.run_dir),
                "NATS_URL": self.opts.nats_url,
            }
        )
        if self.job_credentials is not None:
            env["TORCHRELAY_NATS_CREDENTIALS"] = str(self.job_credentials)
        else:
            env.pop("TORCHRELAY_NATS_CREDENTIALS", None)
        return env

    async def _obtain_job_credentials(self) -> None:
        """Ask the scheduler for this job's credential; write it 0600 into the run dir.

        Only with a credential of our own: on an open server the children need none.
        """
        o = self.opts
        if not o.credentials:
            return
        # The scheduler may be restarting: keep asking for a while.
        deadline = time.monotonic() + 40.0
        while True:
            try:
                got = await self.bus.request(
                    Subjects.rpc("scheduler", "job_credentials"),
                    JobCredentialsRequest(job_id=o.job_id, tenant=o.tenant, claim=self._claim),
                    timeout=10.0,
                )
                break
            except NoResponder:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)
        creds = JobCredentials.model_validate(got)
        path = o.run_dir / "nats-job.cred"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"{creds.user}:{creds.password}\n")
        os.chmod(path, 0o600)
        if o.run_as is not None:
            os.chown(path, *o.run_as)
        self.job_credentials = path

    async def _revoke_job_credentials(self) -> None:
        """The job ended: its credential stops working (the scheduler also revokes it on
        ``job.finished``, and it expires on its own)."""
        if self.job_credentials is None:
            return
        with contextlib.suppress(BusError):
            await self.bus.request(
                Subjects.rpc("scheduler", "job_credentials_revoke"),
                JobCredentialsRevoke(job_id=self.opts.job_id, claim=self._claim),
                timeout=5.0,
            )
        with contextlib.suppress(OSError):
            self.job_credentials.unlink()

    async def _spawn(self, child: Child) -> None:
        self.children[child.member_id] = child
        env = self._env(child)
        latch = DeathLatch.create()
        if latch is not None:
            env.update(latch.child_env())
        try:
            as_user: dict[str, Any] = {}
            if self.opts.run_as is not None:
                uid, gid = self.opts.run_as
                as_user = {"user": uid, "group": gid, "extra_groups": []}
            child.proc = await asyncio.create_subprocess_exec(
                self.opts.python,
                *(("-m",) if self.opts.module else ()),
                self.opts.script,
                *self.opts.script_args,
                env=env,
                pass_fds=(latch.fd,) if latch is not None and latch.fd is not None else (),
                **as_user,
            )
        finally:
            if latch is not None:
                latch.spawned()
        if latch is not None:
            loop = asyncio.get_running_loop()
            child.latch = latch
            latch.watch(
                child.proc.pid,
                lambda status: loop.call_soon_threadsafe(self._dying, child, status),
            )
        self._tasks.append(asyncio.create_task(self._reap(child)))

    def _dying(self, child: Child, code: int) -> None:
        """The child's latch says it is dying with ``code``: a lost worker is reported now,
        not once the kernel has torn it down (``deathlatch``); ``_reap`` does the rest."""
        if child.exit_code is not None or child.stopping or child.reported_lost:
            return
        record = self._exit_record(child.member_id)
        if classify_exit(code, record) != "lost":
            return  # finishing, fenced, or the user's error: nothing urgent, _reap reports it
        self._mark("dying", member=child.member_id, code=code)
        child.reported_lost = True
        child.lost_at = time.monotonic()
        self._tasks.append(asyncio.create_task(self._report_exit(child, code, "lost", record)))

    def _new_spare(self, node: str, gpu: int) -> Child:
        child = Child(f"{self.opts.job_id}-s{self._next_spare}", Role.SPARE, node, gpu)
        self._next_spare += 1
        return child

    async def _start_node_agents(self) -> None:
        """One detector node agent per simulated node, simulator backend (docs/interfaces.md).

        They make ``torchrelay chaos xid|ecc|...`` reach the job's slots. Skipped, with a
        note, where the detector service's code is not installed.
        """
        o = self.opts
        if not o.node_agents:
            return
        if importlib.util.find_spec("services.detector") is None:
            print(
                "torchrelay run: note: services.detector is not installed; no simulated "
                "node agents (chaos xid/ecc/... will find no node)",
                file=sys.stderr,
            )
            return
        total = o.nproc + o.spares
        gpus = max(8, -(-total // o.nodes) + 2)  # room for cold spares spawned later
        env = {**os.environ, "NATS_URL": o.nats_url, "TORCHRELAY_CLUSTER": o.cluster}
        if o.node_agent_credentials:
            env["TORCHRELAY_NATS_CREDENTIALS"] = o.node_agent_credentials
        else:
            env.pop("TORCHRELAY_NATS_CREDENTIALS", None)
        for k in range(o.nodes):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "services.detector",
                "agent",
                "--node",
                f"{o.cluster}-{k}",
                "--cluster",
                o.cluster,
                "--backend",
                "sim",
                "--gpus",
                str(gpus),
                env=env,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            self._node_agents.append(proc)

    async def _stop_node_agents(self) -> None:
        for proc in self._node_agents:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        for proc in self._node_agents:
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

    async def _spawn_all(self) -> None:
        o = self.opts
        for i in range(o.nproc):
            node, gpu = slot_of(i, o.nodes, o.cluster)
            await self._spawn(Child(f"{o.job_id}-w{i}", Role.WORKER, node, gpu))
        for j in range(o.spares):
            node, gpu = slot_of(o.nproc + j, o.nodes, o.cluster)
            await self._spawn(self._new_spare(node, gpu))

    # ----------------------------------------------------------------- exits

    def _exit_record(self, member_id: str) -> dict[str, Any] | None:
        path = self.opts.run_dir / f"{member_id}.exit.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _mark(self, event: str, **fields: Any) -> None:
        """Append a timed event to ``$TORCHRELAY_AGENT_TIMELINE/launcher-<job>.timeline``.

        Like the agents' recovery timeline: when this launcher saw a member exit and when
        its report was out, to line up with the agents' phases and the services' spans.
        """
        folder = os.environ.get("TORCHRELAY_AGENT_TIMELINE")
        if not folder:
            return
        line = json.dumps({"t": time.time(), "event": event, **fields})
        path = Path(folder) / f"launcher-{self.opts.job_id}.timeline"
        with contextlib.suppress(OSError), path.open("a") as out:
            out.write(line + "\n")

    async def _reap(self, child: Child) -> None:
        assert child.proc is not None
        code = await child.proc.wait()
        self._mark("reaped", member=child.member_id, code=code)
        if child.latch is not None:
            child.latch.close()
        child.exit_code = code
        record = self._exit_record(child.member_id)
        child.outcome = classify_exit(code, record)
        if child.stopping and child.outcome == "lost":
            child.outcome = "stopped"  # by the launcher itself (end of job, Ctrl-C)
        if child.outcome == "lost" and child.lost_at is None:
            child.lost_at = time.monotonic()
        if not child.stopping:
            print(
                f"torchrelay run: {child.member_id} {describe_exit(code)} ({child.outcome})",
                file=sys.stderr,
                flush=True,
            )
            if not (child.reported_lost and child.outcome == "lost"):
                await self._report_exit(child, code, child.outcome, record)
        self._changed.set()

    async def _report_exit(
        self, child: Child, code: int, outcome: str, record: dict[str, Any] | None
    ) -> None:
        # The newest generation this launcher read (at most a second old: _supervise reads
        # it every second) rather than a read now, which would delay the report of a lost
        # rank. Its rank is only informative: the detector judges the exit by its own view
        # of the job's generations.
        current = self._last_gen if self._last_gen is not None else await self._generation()
        rank = current.member_rank(child.member_id) if current is not None else None
        detail = describe_exit(code)
        if outcome == "application_error" and record is not None:
            detail = str(record.get("error", ""))[-7000:]
        report = AgentReport(
            event_id=make_event_id("worker_exit", child.member_id),
            source=self.launcher_id,
            job_id=self.opts.job_id,
            member_id=child.member_id,
            kind=ReportKind.WORKER_EXIT,
            role=child.role,
            rank=rank,
            generation=current.generation if current is not None else 0,
            exit_code=code,
            error=f"{outcome}: {detail}",
            node=child.node,
            gpu=child.gpu,
            pid=child.pid,
            cluster=self.opts.cluster,
        )
        try:
            await self.bus.publish(report, Subjects.agent_report(self.opts.job_id), retry_for=10.0)
            self._mark("exit_reported", member=child.member_id)
        except BusError as exc:
            print(
                f"torchrelay run: could not report {child.member_id}'s exit: {exc}", file=sys.stderr
            )

    async def _generation(self) -> Generation | None:
        try:
            found = await self.bus.get_generation(self.opts.job_id)
        except Exception:
            return None
        if found is None:
            return None
        if self._last_gen is None or found[0].generation >= self._last_gen.generation:
            self._last_gen = found[0]
        return found[0]

    # ----------------------------------------------------------------- control plane

    async def _register(self) -> None:
        o = self.opts
        event = JobRegistered(
            event_id=make_event_id("job", o.job_id),
            source=self.launcher_id,
            job_id=o.job_id,
            tenant=o.tenant,
            cluster=o.cluster,
            world_size=o.nproc,
            spares=o.spares,
            policy=o.policy,
            wait_timeout_s=o.wait_timeout_s,
            allow_shrink=o.allow_shrink,
            launcher_id=self.launcher_id,
            members=[
                Member(member_id=c.member_id, role=c.role, node=c.node, gpu=c.gpu, pid=c.pid)
                for c in self.children.values()
            ],
        )
        await self.bus.publish(event, Subjects.JOB_REGISTERED)
        for child in self.children.values():
            if child.role == Role.SPARE:
                # In the background: a registration that waits for its slot to be let go
                # must not hold up the job's start.
                self._tasks.append(asyncio.create_task(self._register_spare(child)))

    async def _register_spare(self, child: Child) -> None:
        slot = SpareSlot(
            slot_id=f"{self.opts.cluster}:{child.node}:{child.gpu}",
            cluster=self.opts.cluster,
            node=child.node,
            gpu=child.gpu,
            state=SpareState.HOT,
            job_id=self.opts.job_id,
            member_id=child.member_id,
            gpu_model="cpu-sim",
        )
        problem = await register_hot_spare(self.bus, slot)
        if problem is not None:
            print(f"torchrelay run: warning: {problem}", file=sys.stderr)

    async def _serve(
        self, subject: str, handler: Callable[[dict[str, Any]], Awaitable[Any]]
    ) -> None:
        """Answer ``subject`` with the same reply envelope as the services' RPCs."""

        async def _on(msg: Msg) -> None:
            try:
                body = json.loads(msg.data or b"{}")
                if not isinstance(body, dict):
                    raise LauncherError("request body must be a JSON object")
                reply = RpcReply(ok=True, result=await handler(body))
            except ValidationError as exc:
                text, fld = validation_message(exc)
                reply = RpcReply(ok=False, error=RpcError(code="invalid", message=text, field=fld))
            except (LauncherError, ValueError) as exc:
                reply = RpcReply(ok=False, error=RpcError(code="invalid", message=str(exc)))
            except KeyError as exc:
                reply = RpcReply(
                    ok=False, error=RpcError(code="not_found", message=str(exc.args[0]))
                )
            if msg.reply:
                with contextlib.suppress(Exception):
                    await msg.respond(reply.model_dump_json().encode())

        self._subs.append(await self.bus.nc.subscribe(subject, cb=_on))

    async def _on_fence(self, body: dict[str, Any]) -> dict[str, Any]:
        order = FenceOrder.model_validate(body)
        child = self.children.get(order.member_id)
        if child is None:
            raise KeyError(f"{order.member_id} is not a member of job {self.opts.job_id}")
        killed = False
        if child.alive and child.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGCONT)  # a stopped process must die too
                child.proc.kill()
                killed = True
        return {"member_id": child.member_id, "killed": killed, "exit_code": child.exit_code}

    async def _on_spawn_spare(self, body: dict[str, Any]) -> dict[str, Any]:
        node, gpu = body.get("node"), body.get("gpu")
        if not isinstance(node, str) or not isinstance(gpu, int):
            raise LauncherError('spawn_spare needs {"node": str, "gpu": int}')
        child = self._new_spare(node, gpu)
        await self._spawn(child)
        self._changed.set()
        return {"member_id": child.member_id, "pid": child.pid, "slot_id": body.get("slot_id")}

    async def _on_pid(self, body: dict[str, Any]) -> dict[str, Any]:
        member_id = body.get("member_id")
        current = await self._generation()
        if member_id is None:
            rank = body.get("rank")
            if not isinstance(rank, int):
                raise LauncherError('pid needs {"rank": int} or {"member_id": str}')
            if current is None:
                raise KeyError(f"job {self.opts.job_id} has no generation yet")
            member_id = next((a.member_id for a in current.ranks if a.rank == rank), None)
            if member_id is None:
                raise KeyError(f"job {self.opts.job_id} has no rank {rank}")
        child = self.children.get(str(member_id))
        if child is None:
            raise KeyError(f"{member_id} is not a member of job {self.opts.job_id}")
        return {
            "member_id": child.member_id,
            "pid": child.pid,
            "alive": child.alive,
            "rank": current.member_rank(child.member_id) if current else None,
            "generation": current.generation if current else 0,
        }

    # ----------------------------------------------------------------- supervision

    def _on_signal(self, signum: int) -> None:
        if self._interrupted is None:
            print(
                f"torchrelay run: {signal.Signals(signum).name}: stopping job {self.opts.job_id}",
                file=sys.stderr,
                flush=True,
            )
        self._interrupted = signum
        for child in self.children.values():
            if child.alive and child.proc is not None:
                child.stopping = True
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGCONT)
                    child.proc.send_signal(signum)
        self._changed.set()

    async def _stop_all(self, grace_s: float = STOP_GRACE_S, sig: int = signal.SIGTERM) -> None:
        alive = [c for c in self.children.values() if c.alive and c.proc is not None]
        for child in alive:
            child.stopping = True
            with contextlib.suppress(ProcessLookupError):
                assert child.proc is not None
                child.proc.send_signal(signal.SIGCONT)
                child.proc.send_signal(sig)
        deadline = time.monotonic() + grace_s
        for child in alive:
            assert child.proc is not None
            try:
                await asyncio.wait_for(child.proc.wait(), max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
                await child.proc.wait()

    def _verdict(self, current: Generation | None) -> tuple[Outcome, str] | None:
        """``(outcome, summary)`` once the job is over, else None."""
        kids = self.children.values()
        app = [c for c in kids if c.outcome == "application_error"]
        if app:
            return "failed", (
                f"{app[0].member_id} raised in user code (application error); "
                f"see {self.opts.run_dir / (app[0].member_id + '.exit.json')}"
            )
        if self._gave_up is not None:
            return "failed", self._gave_up
        if current is not None:
            holders = [self.children.get(a.member_id) for a in current.ranks]
            if all(h is not None and h.outcome == "finished" for h in holders):
                return "succeeded", (
                    f"all {current.world_size} ranks finished in generation {current.generation}"
                )
            # Ranks finish only together (they agree on the last step), so world_size
            # finished members mean the job is done even if a newer generation was written
            # for a rank that had already finished.
            if sum(c.outcome == "finished" for c in kids) >= current.world_size:
                return "succeeded", f"{current.world_size} ranks finished the last step"
        bound = self.opts.wait_timeout_s + GIVE_UP_MARGIN_S
        now = time.monotonic()
        for c in kids:
            if (
                c.outcome == "lost"
                and c.lost_at is not None
                and now - c.lost_at > bound
                and (current is None or current.member_rank(c.member_id) is not None)
            ):
                return "failed", (
                    f"{c.member_id} was lost and its rank was not replaced within {bound:.0f}s"
                )
        if all(not c.alive for c in kids):
            return "failed", "every process of the job exited before it finished"
        return None

    async def _supervise(self) -> tuple[Outcome, str]:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 1.0)
            self._changed.clear()
            if self._interrupted is not None:
                return "cancelled", f"stopped by {signal.Signals(self._interrupted).name}"
            verdict = self._verdict(await self._generation())
            if verdict is not None:
                return verdict

    async def run(self) -> int:
        """Launch, supervise and end the job; returns the exit code for the shell."""
        o = self.opts
        try:
            prepare_run_dir(o.run_dir, o.run_as)
        except LauncherError as exc:
            print(f"torchrelay run: {exc}", file=sys.stderr)
            return EXIT_USAGE
        try:
            self._bus = await Bus.connect(
                o.nats_url, f"launcher-{o.job_id}", credentials=o.credentials, timeout=10.0
            )
        except BusError as exc:
            print(f"torchrelay run: {exc}", file=sys.stderr)
            return EXIT_USAGE
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal, signum)
        try:
            await self._ensure_streams()
            try:
                await self._obtain_job_credentials()
            except BusError as exc:
                print(
                    f"torchrelay run: no credential for job {o.job_id} from the scheduler: {exc}",
                    file=sys.stderr,
                )
                return EXIT_USAGE
            for verb, handler in (("spawn_spare", self._on_spawn_spare), ("pid", self._on_pid)):
                await self._serve(Subjects.launcher(o.job_id, verb), handler)
            await self._serve(Subjects.fence(o.job_id), self._on_fence)
            self._subs.append(
                await self.bus.nc.subscribe(Subjects.MIGRATION_FAILED, cb=self._on_migration_failed)
            )
            # The control plane may fence or ask for a spare as soon as the job registers:
            # the server must have these subscriptions first.
            try:
                await self.bus.confirm()
            except BusError as exc:
                print(f"torchrelay run: {exc}", file=sys.stderr)
                await self._revoke_job_credentials()
                return EXIT_USAGE
            await self._start_node_agents()
            await self._spawn_all()
            (o.run_dir / "launcher.json").write_text(
                json.dumps(
                    {
                        "job_id": o.job_id,
                        "launcher_pid": os.getpid(),
                        "members": {c.member_id: c.pid for c in self.children.values()},
                    }
                )
            )
            await self._register()
            outcome, summary = await self._supervise()
            if outcome != "succeeded" or any(c.alive for c in self.children.values()):
                await self._stop_all(
                    grace_s=0.0 if outcome == "failed" else STOP_GRACE_S,
                    sig=signal.SIGKILL if outcome == "failed" else signal.SIGTERM,
                )
            return await self._finish(outcome, summary)
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            await self._stop_all(grace_s=2.0)
            await self._stop_node_agents()
            for sub in self._subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await self.bus.close()

    async def _on_migration_failed(self, msg: Msg) -> None:
        """The executor gave up live migration for this job: end it with the fallback named."""
        try:
            failed = MigrationFailed.model_validate_json(msg.data)
        except ValueError:
            return
        if failed.job_id != self.opts.job_id or failed.fallback.value == "migrated_live":
            return
        if failed.fallback.value in ("shrunk", "excluded"):
            return  # the job goes on with one rank fewer, or the warning no longer matters
        self._gave_up = (
            f"a rank could not be migrated live ({failed.reason}); the job's policy falls back "
            f"to {failed.fallback.value}: restart it from its last checkpoint"
            if failed.fallback.value == "checkpoint_restart"
            else f"a rank could not be migrated live ({failed.reason}); resolution "
            f"{failed.fallback.value}"
        )
        self._changed.set()

    async def _ensure_streams(self) -> None:
        await self.bus.ensure_provisioned()
        await self.bus.generations()

    async def _finish(self, outcome: Outcome, summary: str) -> int:
        current = await self._generation()
        code = {"succeeded": 0, "cancelled": 128 + (self._interrupted or 2)}.get(outcome, 1)
        event = JobFinished(
            event_id=make_event_id("job_finished", self.opts.job_id),
            source=self.launcher_id,
            job_id=self.opts.job_id,
            tenant=self.opts.tenant,
            outcome=outcome,
            exit_code=code,
            summary=summary,
        )
        with contextlib.suppress(BusError):
            await self.bus.publish(event, Subjects.JOB_FINISHED, retry_for=5.0)
        await self._revoke_job_credentials()
        lines = [
            f"torchrelay run: job {self.opts.job_id} {outcome}: {summary}",
            f"  generation: {current.generation if current else 0}",
        ]
        lines += [
            f"  {c.member_id:>24} {c.role.value:<6} {c.node}/gpu{c.gpu} "
            f"{c.outcome or 'running'} ({describe_exit(c.exit_code)})"
            if c.exit_code is not None
            else f"  {c.member_id:>24} {c.role.value:<6} {c.node}/gpu{c.gpu} running"
            for c in self.children.values()
        ]
        print("\n".join(lines), file=sys.stderr, flush=True)
        return code


def options_from_args(args: argparse.Namespace) -> Options:
    """Validate ``torchrelay run`` arguments into :class:`Options`.

    Raises:
        LauncherError: an argument is invalid or no NATS server is configured.
    """
    job_id = args.job_id or f"job-{uuid.uuid4().hex[:8]}"
    if not _TOKEN.match(job_id):
        raise LauncherError(f"--job-id {job_id!r}: use letters, digits, '_' and '-' only")
    if not _TOKEN.match(args.tenant):
        raise LauncherError(f"--tenant {args.tenant!r}: use letters, digits, '_' and '-' only")
    if args.nproc < 1:
        raise LauncherError("--nproc must be at least 1")
    if args.spares < 0 or args.nodes < 1:
        raise LauncherError("--spares must be >= 0 and --nodes >= 1")
    verify_every = getattr(args, "verify_every", None)
    if verify_every is not None and verify_every < 0:
        raise LauncherError("--verify-every must be >= 0 (steps between checks; 0: never)")
    module = bool(getattr(args, "module", False))
    script = Path(args.script)
    if module:
        try:
            found = importlib.util.find_spec(args.script)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise LauncherError(f"-m {args.script}: no such module on this Python's path")
    elif not script.is_file():
        raise LauncherError(f"training script {args.script} does not exist")
    python = getattr(args, "python", None) or sys.executable
    if shutil.which(python) is None:
        raise LauncherError(f"--python {python}: not an executable interpreter")
    run_as_user = getattr(args, "run_as", None)
    run_as = run_as_ids(run_as_user) if run_as_user else None
    if run_as is not None and not module:
        script = script.resolve()  # the training user may not share the launcher's cwd
    cluster = os.environ.get("TORCHRELAY_CLUSTER", "local")
    home = Path(os.environ.get("TORCHRELAY_HOME", ".torchrelay"))
    script_args = list(args.args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    return Options(
        nproc=args.nproc,
        spares=args.spares,
        job_id=job_id,
        tenant=args.tenant,
        nodes=args.nodes,
        policy=JobPolicy(args.policy),
        wait_timeout_s=float(getattr(args, "wait_timeout", 60.0)),
        allow_shrink=bool(getattr(args, "allow_shrink", False)),
        script=str(script),
        script_args=script_args,
        nats_url=resolve_nats_url(),
        cluster=cluster,
        run_dir=(
            (home / "runs" / job_id).resolve()
            if run_as is None
            else Path(tempfile.gettempdir()) / "torchrelay-runs" / job_id
        ),
        run_as=run_as,
        python=python,
        module=module,
        credentials=resolve_credentials("launcher"),
        node_agents=not getattr(args, "no_node_agents", False),
        extra_env={} if verify_every is None else {"TORCHRELAY_VERIFY_EVERY": str(verify_every)},
        node_agent_credentials=os.environ.get("TORCHRELAY_NODE_AGENT_CREDENTIALS")
        or resolve_credentials(
            "node_agent",
            {k: v for k, v in os.environ.items() if k != "TORCHRELAY_NATS_CREDENTIALS"},
        ),
    )


def cmd_run(args: argparse.Namespace) -> int:
    """``torchrelay run``: run SCRIPT with ``--nproc`` workers and ``--spares`` hot spares."""
    try:
        opts = options_from_args(args)
    except LauncherError as exc:
        print(f"torchrelay run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(
        f"torchrelay run: job {opts.job_id}: {opts.nproc} workers, {opts.spares} spares "
        f"on {opts.nodes} node(s); run dir {opts.run_dir}",
        file=sys.stderr,
        flush=True,
    )
    return asyncio.run(Launcher(opts).run())
