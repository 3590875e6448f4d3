"""The launcher of one job: its children, its registration, its answers on NATS, its verdict."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg
from pydantic import ValidationError

from torchrelay.bus import Bus, BusError, NoResponder, validation_message
from torchrelay.contract import (
    AgentReport,
    FenceOrder,
    Generation,
    HostJoined,
    JobCredentials,
    JobCredentialsRequest,
    JobCredentialsRevoke,
    JobFinished,
    JobRegistered,
    Member,
    MigrationFailed,
    ReportKind,
    Resolution,
    Role,
    RpcError,
    RpcReply,
    SpareSlot,
    SpareState,
    Subjects,
    make_event_id,
)
from torchrelay.deathlatch import DeathLatch
from torchrelay.launcher._agents import start_node_agents, stop_node_agents
from torchrelay.launcher._hosts import (
    NOT_MINE,
    beat,
    gpu_model,
    host_verdict,
    job_end,
    join_host,
    stopped,
)
from torchrelay.launcher._restart import Restarts
from torchrelay.launcher._setup import (
    EXIT_HOST_REFUSED,
    EXIT_USAGE,
    GIVE_UP_MARGIN_S,
    STACK_ONLY_ENV,
    STOP_GRACE_S,
    Child,
    HostRefused,
    LauncherError,
    Options,
    Outcome,
    classify_exit,
    describe_exit,
    prepare_run_dir,
    register_hot_spare,
    slot_of,
    with_process_defaults,
)
from torchrelay.runtime import machine_id, without_installed_services


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
        # Binds the job's credential to this launcher: only it may mint or revoke it. The
        # launchers of a job across hosts share the job's claim (TORCHRELAY_JOB_CLAIM).
        host = opts.host
        self._claim = host.claim if host is not None and host.claim else secrets.token_urlsafe(32)
        self._joined: HostJoined | None = None  # this host's place in a job across hosts
        self._ended: str | None = None  # the job's end as the control plane recorded it
        self._world_size = opts.nproc
        self._beat: asyncio.Task[None] | None = None
        self._restarts = Restarts(opts)  # checkpoint_restart (docs/design.md §13)

    def _mine(self, node: str) -> bool:
        """Whether work for ``node`` is this launcher's: every (simulated) node on one host,
        only its own host in a job across hosts."""
        return self.opts.host is None or node == self.opts.host.node

    @property
    def bus(self) -> Bus:
        assert self._bus is not None
        return self._bus

    # ----------------------------------------------------------------- spawning

    def _env(self, child: Child) -> dict[str, str]:
        # The customer's code gets its job credential and nothing of the stack's.
        env = {k: v for k, v in os.environ.items() if k not in STACK_ONLY_ENV}
        env.update(self.opts.extra_env)
        env = without_installed_services(env)
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
                # torchrun's names; a spare's RANK is set by torchrelay.init() once it has one.
                "LOCAL_RANK": str(child.local_rank),
                # A spare host's ranks are the ones its spares take.
                "LOCAL_WORLD_SIZE": str(self.opts.nproc or self.opts.spares),
                "WORLD_SIZE": str(self._world_size),
            }
        )
        env.pop("RANK", None)
        if child.rank is not None:
            env["RANK"] = str(child.rank)
        host = self.opts.host
        if host is not None and host.advertise_host and "TORCHRELAY_ADVERTISE_HOST" not in env:
            env["TORCHRELAY_ADVERTISE_HOST"] = host.advertise_host
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
                    JobCredentialsRequest(
                        job_id=o.job_id, tenant=o.tenant, claim=self._claim, seat=self._seat()
                    ),
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
                JobCredentialsRevoke(job_id=self.opts.job_id, claim=self._claim, seat=self._seat()),
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
        if child.exit_code is not None or child.stopping or child.fenced or child.reported_lost:
            return
        record = self._exit_record(child.member_id)
        if classify_exit(code, record) != "lost":
            return  # finishing, fenced, or the user's error: nothing urgent, _reap reports it
        self._mark("dying", member=child.member_id, code=code)
        child.reported_lost = True
        child.lost_at = time.monotonic()
        self._tasks.append(asyncio.create_task(self._report_exit(child, code, "lost", record)))

    def _seat(self) -> str | None:
        return None if self.opts.host is None else self.opts.host.seat()

    def _new_spare(self, node: str, gpu: int, local_rank: int = 0) -> Child:
        # Spares of a job across hosts carry their host's name: unique across launchers.
        host = self.opts.host
        prefix = self.opts.job_id if host is None else f"{self.opts.job_id}-{host.token}"
        child = Child(f"{prefix}-s{self._next_spare}", Role.SPARE, node, gpu, local_rank=local_rank)
        self._next_spare += 1
        return child

    async def _start_node_agents(self) -> None:
        self._node_agents = await start_node_agents(self.opts)

    async def _stop_node_agents(self) -> None:
        await stop_node_agents(self._node_agents)

    async def _spawn_all(self) -> None:
        o = self.opts
        if o.host is not None:
            base = 0 if self._joined is None else self._joined.node_rank * o.nproc
            for i in range(o.nproc):
                member = f"{o.job_id}-w{base + i}"
                gpu = o.host.gpus[i]
                await self._spawn(
                    Child(member, Role.WORKER, o.host.node, gpu, local_rank=i, rank=base + i)
                )
            for j in range(o.spares):
                k = o.nproc + j
                await self._spawn(self._new_spare(o.host.node, o.host.gpus[k], local_rank=k))
            return
        for i in range(o.nproc):
            node, gpu = slot_of(i, o.nodes, o.cluster)
            member = f"{o.job_id}-w{i}"
            await self._spawn(Child(member, Role.WORKER, node, gpu, local_rank=i, rank=i))
        for j in range(o.spares):
            node, gpu = slot_of(o.nproc + j, o.nodes, o.cluster)
            await self._spawn(self._new_spare(node, gpu, local_rank=o.nproc + j))

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
        if child.fenced and child.outcome in ("lost", "stopped"):
            child.outcome = "fenced"  # killed on a fence order, or stopped after losing its rank
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
        if o.host is not None and o.host.spare_host:
            # A spare host brings hot spares to a job its worker hosts registered.
            for child in self.children.values():
                self._tasks.append(asyncio.create_task(self._register_spare(child)))
            return
        joined = self._joined
        event = JobRegistered(
            event_id=(
                make_event_id("job", o.job_id)
                if joined is None
                else make_event_id("job", o.job_id, "host", joined.node_rank)
            ),
            source=self.launcher_id,
            job_id=o.job_id,
            tenant=o.tenant,
            cluster=o.cluster,
            world_size=self._world_size,
            nnodes=1 if joined is None else joined.nnodes,
            node_rank=None if joined is None else joined.node_rank,
            spares=o.spares,
            policy=o.policy,
            wait_timeout_s=o.wait_timeout_s,
            allow_shrink=o.allow_shrink,
            launcher_id=self.launcher_id,
            checkpoint_every=o.checkpoint_every,
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
            gpu_model=(
                "cpu-sim"
                if self.opts.host is None
                else gpu_model(child.gpu, self.opts.host.simulate_gpus)
            ),
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
                result = await handler(body)
                if result is NOT_MINE:
                    return  # another host's launcher answers (every one of the job listens)
                reply = RpcReply(ok=True, result=result)
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

    async def _on_fence(self, body: dict[str, Any]) -> Any:
        order = FenceOrder.model_validate(body)
        child = self.children.get(order.member_id)
        if child is None and self.opts.host is not None:
            return NOT_MINE
        if child is None:
            raise KeyError(f"{order.member_id} is not a member of job {self.opts.job_id}")
        killed = False
        if child.alive and child.proc is not None:
            child.fenced = True
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGCONT)  # a stopped process must die too
                child.proc.kill()
                killed = True
        return {"member_id": child.member_id, "killed": killed, "exit_code": child.exit_code}

    async def _on_spawn_spare(self, body: dict[str, Any]) -> Any:
        node, gpu = body.get("node"), body.get("gpu")
        if not isinstance(node, str) or not isinstance(gpu, int):
            raise LauncherError('spawn_spare needs {"node": str, "gpu": int}')
        if not self._mine(node):
            return NOT_MINE
        child = self._new_spare(node, gpu, local_rank=len(self.children))
        await self._spawn(child)
        self._changed.set()
        return {"member_id": child.member_id, "pid": child.pid, "slot_id": body.get("slot_id")}

    async def _on_pid(self, body: dict[str, Any]) -> Any:
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
        if child is None and self.opts.host is not None:
            return NOT_MINE
        if child is None:
            raise KeyError(f"{member_id} is not a member of job {self.opts.job_id}")
        return {
            "member_id": child.member_id,
            "pid": child.pid,
            "alive": child.alive,
            "rank": current.member_rank(child.member_id) if current else None,
            "generation": current.generation if current else 0,
            "node": child.node,
            "machine": machine_id(),
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
        current = self._last_gen
        for child in alive:
            child.stopping = True
            # A worker the newest generation no longer names (its host was cut off while
            # another took its rank) ends fenced, whoever stops it.
            if (
                child.rank is not None
                and current is not None
                and current.member_rank(child.member_id) is None
            ):
                child.fenced = True
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
        if self.opts.host is not None:
            return host_verdict(
                list(self.children.values()),
                current,
                self._ended,
                self._gave_up,
                self.opts.wait_timeout_s + GIVE_UP_MARGIN_S,
                self.opts.run_dir,
            )
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
            if self._restarts.busy():
                continue  # the processes are being replaced: no verdict on them
            if self._interrupted is not None:
                return "cancelled", f"stopped by {signal.Signals(self._interrupted).name}"
            if self.opts.host is not None and self._ended is None:
                self._ended = await job_end(self.bus, self.opts.job_id)
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
                await self._join()
            except LauncherError as exc:
                print(f"torchrelay run: {exc}", file=sys.stderr)
                return EXIT_HOST_REFUSED if isinstance(exc, HostRefused) else EXIT_USAGE
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
            self._write_launcher_file()
            await self._register()
            if o.host is not None:
                self._beat = asyncio.create_task(
                    beat(self.bus, o.job_id, self.launcher_id, o.host.node, o.cluster)
                )
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
        self._restarts.note(failed)
        if self._restarts.covers(failed):
            return  # one restart replaces every process: the other failures' too
        problem = None
        if failed.fallback == Resolution.CHECKPOINT_RESTART:
            problem = await self._restarts.take(self, failed)
            if problem is None:
                return
        why = f"a rank could not be migrated live ({failed.reason})"
        self._gave_up = (
            f"{why}; resolution {failed.fallback.value}"
            if problem is None
            else f"{why}; the job's policy falls back to checkpoint_restart, but {problem}"
        )
        self._changed.set()

    def _write_launcher_file(self) -> None:
        (self.opts.run_dir / "launcher.json").write_text(
            json.dumps(
                {
                    "job_id": self.opts.job_id,
                    "launcher_pid": os.getpid(),
                    "members": {c.member_id: c.pid for c in self.children.values()},
                }
            )
        )

    async def _join(self) -> None:
        """A worker host joins its job's rendezvous: its node rank, the world size."""
        host = self.opts.host
        if host is None:
            return
        if host.spare_host:
            self.launcher_id = f"{self.opts.job_id}-launcher-{host.token}"
            return
        if self.opts.credentials and not host.claim:
            raise LauncherError(
                "a job across hosts needs its claim on every host: set TORCHRELAY_JOB_CLAIM "
                "to the same secret (16+ characters) for each of the job's launchers"
            )
        self._joined = await join_host(self.bus, self.opts.job_id, self.opts.tenant, host)
        host.node_rank = self._joined.node_rank
        self._world_size = self._joined.world_size
        self.launcher_id = f"{self.opts.job_id}-launcher-h{host.node_rank}"
        print(
            f"torchrelay run: host {host.node} is node {host.node_rank} of "
            f"{self._joined.nnodes} (world size {self._world_size})",
            file=sys.stderr,
            flush=True,
        )

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
        if self._beat is not None:
            self._beat.cancel()
        if (host := self.opts.host) is not None:
            await stopped(
                self.bus, self.opts.job_id, self.launcher_id, host.node, self.opts.cluster
            )
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
