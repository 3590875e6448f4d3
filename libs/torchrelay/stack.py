"""``torchrelay up`` / ``down``: the whole stack on this machine, every service its own process.

The supervisor starts the embedded servers (unless ``NATS_URL``/``REDIS_URL`` point
elsewhere), starts each service on a fixed port, waits until every ``/readyz`` answers,
writes ``stack.json``, and restarts a crashed service with backoff (a crashed server at once,
on its port and data).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.auth import ADMIN, REVOKER, AuthBundle, ensure_bundle
from torchrelay.bus import Bus, BusError
from torchrelay.contract import SERVICES
from torchrelay.runtime import (
    ServerProcess,
    free_port,
    nats_server,
    redis_server,
    services_path,
    with_services_path,
)
from torchrelay.settings import DEV_OPERATOR_TOKEN_PREFIX

log = logging.getLogger("torchrelay.stack")

READY_TIMEOUT_S = 60.0
MAX_BACKOFF_S = 8.0
MAX_SERVICE_REPLICAS = 5


def service_replicas(raw: str | None) -> int:
    """``--replicas`` / ``TORCHRELAY_SERVICE_REPLICAS``: processes per service, 1 to 5."""
    if raw is None or raw.strip() == "":
        return 1
    try:
        count = int(raw)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_SERVICE_REPLICAS:
        raise ValueError(
            f"--replicas / TORCHRELAY_SERVICE_REPLICAS {raw!r}: give a whole number of "
            "processes per service, "
            f"1 to {MAX_SERVICE_REPLICAS}"
        )
    return count


def instance_key(service: str, replica: int) -> str:
    """The supervisor's name of one process: the service's name for its first replica."""
    return service if replica == 0 else f"{service}.{replica}"


def state_dir_from(arg: str | None) -> Path:
    """The state directory: ``--state-dir``, else ``TORCHRELAY_HOME``, else ``./.torchrelay``."""
    return Path(arg or os.environ.get("TORCHRELAY_HOME") or ".torchrelay").resolve()


def read_stack(state_dir: Path) -> dict[str, Any] | None:
    """The ``stack.json`` of a running stack, or None."""
    path = state_dir / "stack.json"
    if not path.exists():
        return None
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except ValueError:
        return None
    return data


def _ready(port: int, pid: int | None, host: str = "127.0.0.1") -> bool:
    """``/readyz`` on ``port`` answers 200 from the process ``pid`` (not another on the port)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/readyz", timeout=1.0) as resp:
            body = json.loads(resp.read() or b"{}")
            return int(resp.status) == 200 and isinstance(body, dict) and body.get("pid") == pid
    except (OSError, ValueError):
        return False


@dataclass
class ManagedService:
    """One service process under supervision."""

    name: str
    port: int
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    backoff_s: float = 0.5
    next_start: float = 0.0
    started_at: float = 0.0
    ready: bool = False
    died_unready: bool = False  # its last run ended before it was ever ready
    host: str = "127.0.0.1"  # where its HTTP server listens

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", f"services.{self.name}"],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started_at = time.monotonic()
        self.ready = False

    def stop(self, timeout: float = 6.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@dataclass
class Supervisor:
    """Starts and watches the servers and the six services of one stack."""

    state_dir: Path
    nats_url: str | None = None
    redis_url: str | None = None
    services: dict[str, ManagedService] = field(default_factory=dict)
    servers: dict[str, ServerProcess] = field(default_factory=dict)
    operator_token: str | None = None
    stopping: bool = False
    auth: AuthBundle | None = None
    nats_auth: bool = False
    # ``torchrelay up --bind ADDR``: NATS, Redis and the API listen on ADDR, for hosts
    # elsewhere (the other services' health endpoints stay on loopback).
    bind: str = field(default_factory=lambda: os.environ.get("TORCHRELAY_BIND") or "127.0.0.1")
    # ``torchrelay up --replicas R``: R processes of every service (docs/design.md §10).
    replicas: int = field(
        default_factory=lambda: service_replicas(os.environ.get("TORCHRELAY_SERVICE_REPLICAS"))
    )

    def _auth_bundle(self) -> AuthBundle | None:
        """The stack's credentials: generated under ``<state>/auth`` for embedded servers,
        or the directory ``TORCHRELAY_AUTH_DIR`` (``torchrelay auth init``) for external ones."""
        external = os.environ.get("TORCHRELAY_AUTH_DIR")
        if external:
            return ensure_bundle(Path(external))
        if not self.nats_url or not self.redis_url:
            return ensure_bundle(self.state_dir / "auth")
        return None

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)  # secrets, tokens, the servers' data
        self.auth = self._auth_bundle()
        if not self.nats_url:
            extra = self.auth.nats_authorization() if self.auth else ""
            self.servers["nats"] = nats_server(self.state_dir, extra_config=extra, host=self.bind)
            self.servers["nats"].start()
            self.nats_url = self.servers["nats"].url
            self.nats_auth = self.auth is not None
        else:
            self.nats_auth = bool(os.environ.get("TORCHRELAY_AUTH_DIR"))
        self.provision()
        redis_host = redis_port = None
        if not self.redis_url:
            self.servers["redis"] = redis_server(
                self.state_dir,
                password=self.auth.redis_password if self.auth else None,
                aclfile=self.auth.redis_acl_path if self.auth else None,
                host=self.bind,
            )
            self.servers["redis"].start()
            self.redis_url = self.servers["redis"].url
            redis_host, redis_port = self.servers["redis"].host, self.servers["redis"].port
        embedded = "nats" in self.servers and "redis" in self.servers
        self.operator_token = os.environ.get("TORCHRELAY_OPERATOR_TOKEN") or (
            DEV_OPERATOR_TOKEN_PREFIX + secrets.token_urlsafe(24) if embedded else None
        )
        base = dict(os.environ)
        base.update(
            {
                "NATS_URL": self.nats_url,
                "REDIS_URL": self.redis_url,
                "TORCHRELAY_HOME": str(self.state_dir),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if embedded:
            base.setdefault("TORCHRELAY_ENVIRONMENT", "development")
        if self.operator_token:
            base["TORCHRELAY_OPERATOR_TOKEN"] = self.operator_token
        for name, replica in [(n, r) for n in SERVICES for r in range(self.replicas)]:
            host = self.bind if name == "api" else "127.0.0.1"
            port = free_port(host)
            env = dict(
                base,
                TORCHRELAY_HTTP_PORT=str(port),
                TORCHRELAY_HTTP_HOST=host,
                TORCHRELAY_REPLICA=str(replica),
            )
            if self.auth is not None and self.nats_auth:
                env["TORCHRELAY_NATS_CREDENTIALS"] = str(self.auth.cred_path(name))
                if name == "scheduler":
                    env["TORCHRELAY_AUTH_ISSUER_SEED_FILE"] = str(
                        self.auth.directory / "issuer.seed"
                    )
                    env["TORCHRELAY_NATS_REVOKER_CREDENTIALS"] = str(self.auth.cred_path(REVOKER))
            if self.auth is not None and redis_host is not None and redis_port is not None:
                # Each service its own Redis user, limited to its key prefix.
                env["REDIS_URL"] = self.auth.redis_url(redis_host, redis_port, role=name)
            key = instance_key(name, replica)
            log_file = self.state_dir / "logs" / f"{key}.log"
            svc = ManagedService(name, port, with_services_path(env), log_file, host=host)
            svc.start()
            self.services[key] = svc
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self.tick()
            if all(s.ready for s in self.services.values()):
                break
            time.sleep(0.1)
        else:
            missing = [n for n, s in self.services.items() if not s.ready]
            raise RuntimeError(
                f"services not ready within {READY_TIMEOUT_S:.0f}s: "
                f"{', '.join(missing)}; see {self.state_dir / 'logs'}"
            )
        self.write_stack()

    def provision(self) -> None:
        """Create the streams, the bucket and the durable consumers as ``admin`` (the only
        identity allowed to administer JetStream when authentication is on)."""
        assert self.nats_url is not None
        creds = self.auth.cred_path(ADMIN) if self.auth is not None and self.nats_auth else None
        replicas = int(os.environ.get("TORCHRELAY_STREAM_REPLICAS") or 1)
        asyncio.run(provision_stack(self.nats_url, creds, replicas))

    def tick(self) -> None:
        """Check every process once: mark readiness, restart the dead with backoff."""
        changed = False
        now = time.monotonic()
        for name, server in self.servers.items():
            if not server.alive() and not self.stopping:
                log.warning("%s died; restarting it on its port and data", name)
                with contextlib.suppress(Exception):
                    server.start()
                    changed = True
        for svc in self.services.values():
            if svc.proc is not None and svc.proc.poll() is not None:
                if svc.next_start == 0.0:
                    if now - svc.started_at > 60:
                        svc.backoff_s = 0.5
                    svc.next_start = now + svc.backoff_s
                    log.warning(
                        "service %s exited with %s; restarting in %.1fs (restart #%d)",
                        svc.name,
                        svc.proc.returncode,
                        svc.backoff_s,
                        svc.restarts + 1,
                    )
                    svc.backoff_s = min(svc.backoff_s * 2, MAX_BACKOFF_S)
                    svc.died_unready = not svc.ready
                    svc.ready = False
                if now >= svc.next_start:
                    svc.next_start = 0.0
                    svc.restarts += 1
                    if svc.died_unready:
                        # It died before it was ever ready on this port: the port may have
                        # been taken since free_port() chose it (EADDRINUSE); take another.
                        svc.port = free_port(svc.host)
                        svc.env["TORCHRELAY_HTTP_PORT"] = str(svc.port)
                    svc.start()
                    changed = True
            elif not svc.ready and _ready(svc.port, svc.proc.pid if svc.proc else None, svc.host):
                svc.ready = True
                changed = True
        if changed and all(s.ready for s in self.services.values()):
            self.write_stack()

    def write_stack(self) -> None:
        api = self.services.get("api")
        data = {
            "nats_url": self.nats_url,
            "redis_url": self.redis_url,
            "api_url": f"http://{api.host}:{api.port}" if api else None,
            "operator_token": self.operator_token,
            "auth": bool(self.nats_auth),
            # The credentials `torchrelay run` (launcher), the CLI (operator) and the node
            # agents connect with; `admin` is the break-glass user of tests and recovery.
            "credentials": (
                {
                    role: str(self.auth.cred_path(role))
                    for role in ("launcher", "operator", "node_agent", ADMIN)
                }
                if self.auth is not None and self.nats_auth
                else {}
            ),
            "services": self._services_json(),
            "servers": {n: {"pid": s.pid, "port": s.port} for n, s in self.servers.items()},
            "supervisor_pid": os.getpid(),
        }
        tmp = self.state_dir / "stack.json.tmp"
        tmp.write_text(json.dumps(data, indent=2))
        tmp.chmod(0o600)  # it holds the operator token
        tmp.replace(self.state_dir / "stack.json")

    def _services_json(self) -> dict[str, Any]:
        """stack.json's ``services``: each service's first process, and with ``--replicas``
        every process under ``replicas``."""
        out: dict[str, Any] = {}
        for svc in self.services.values():
            pid = svc.proc.pid if svc.proc else None
            one = {"pid": pid, "port": svc.port, "restarts": svc.restarts}
            entry = out.setdefault(svc.name, dict(one))
            if self.replicas > 1:
                entry.setdefault("replicas", []).append(one)
        return out

    def stop(self) -> None:
        self.stopping = True
        for svc in self.services.values():
            if svc.proc is not None and svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGTERM)
        for svc in self.services.values():
            svc.stop()
        for server in self.servers.values():
            server.stop()
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / "stack.json").unlink()

    def serve_forever(self) -> None:
        stop = False

        def _on_signal(_sig: int, _frame: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
        while not stop:
            self.tick()
            time.sleep(0.2)


async def provision_stack(nats_url: str, credentials: Path | None, replicas: int = 1) -> None:
    """Provision JetStream for the stack (idempotent; updates a changed configuration)."""
    bus = await Bus.connect(
        nats_url, "torchrelay-provision", credentials=str(credentials) if credentials else None
    )
    try:
        await bus.provision(replicas)
    finally:
        await bus.close()


def cmd_provision(args: argparse.Namespace) -> int:
    """``torchrelay provision``: create or update the streams, the generations bucket and
    the durable consumers, with the admin credential (deploy jobs, recovery by hand)."""
    nats_url = args.nats_url or os.environ.get("NATS_URL")
    state_dir = state_dir_from(args.state_dir)
    stack = read_stack(state_dir) or {}
    nats_url = nats_url or stack.get("nats_url")
    if not nats_url:
        print("torchrelay provision: no NATS_URL and no running stack", file=sys.stderr)
        return 2
    creds = args.credentials or os.environ.get("TORCHRELAY_NATS_CREDENTIALS")
    creds = creds or (stack.get("credentials") or {}).get(ADMIN)
    try:
        asyncio.run(provision_stack(nats_url, Path(creds) if creds else None, args.replicas))
    except BusError as exc:
        print(f"torchrelay provision: {exc}", file=sys.stderr)
        return 1
    print(f"torchrelay provision: streams, bucket and consumers ready on {nats_url}")
    return 0


def supervise(state_dir: Path) -> int:
    """Run a supervisor in this process until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    sup = Supervisor(
        state_dir, os.environ.get("NATS_URL") or None, os.environ.get("REDIS_URL") or None
    )
    try:
        sup.start()
        print(
            f"torchrelay stack ready: api {sup.services['api'].port}, state {state_dir}", flush=True
        )
        sup.serve_forever()
    finally:
        sup.stop()
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    """``torchrelay up``: run the stack (foreground), or start it detached and return."""
    state_dir = state_dir_from(args.state_dir)
    bind = getattr(args, "bind", None)
    if bind:
        try:
            ipaddress.ip_address(bind)
        except ValueError:
            print(f"--bind {bind!r}: give an IP address of this host", file=sys.stderr)
            return 2
        os.environ["TORCHRELAY_BIND"] = bind  # the supervisor (here or detached) reads it
    replicas = getattr(args, "replicas", None)
    try:
        service_replicas(replicas or os.environ.get("TORCHRELAY_SERVICE_REPLICAS"))
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if replicas:
        os.environ["TORCHRELAY_SERVICE_REPLICAS"] = str(replicas)
    existing = read_stack(state_dir)
    if existing and _pid_alive(existing.get("supervisor_pid")):
        print(
            f"a stack is already running from {state_dir} (pid {existing['supervisor_pid']}); "
            "`torchrelay down` stops it",
            file=sys.stderr,
        )
        return 1
    if not args.detach:
        return supervise(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        (state_dir / "stack.json").unlink()
    logf = (state_dir / "supervisor.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchrelay.stack", "supervise", "--state-dir", str(state_dir)],
        stdout=logf,
        stderr=logf,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + READY_TIMEOUT_S + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(
                f"the stack failed to start (exit {proc.returncode}); see "
                f"{state_dir / 'supervisor.log'} and {state_dir / 'logs'}",
                file=sys.stderr,
            )
            return 1
        stack = read_stack(state_dir)
        if stack is not None:
            print(
                f"torchrelay is up: api {stack['api_url']}, nats {stack['nats_url']}, "
                f"state {state_dir}/stack.json"
            )
            return 0
        time.sleep(0.2)
    print("the stack did not become ready in time", file=sys.stderr)
    return 1


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def cmd_down(args: argparse.Namespace) -> int:
    """``torchrelay down``: stop a stack started with ``up --detach``."""
    state_dir = state_dir_from(args.state_dir)
    stack = read_stack(state_dir)
    if stack is None or not _pid_alive(stack.get("supervisor_pid")):
        print(f"no running stack in {state_dir}")
        with contextlib.suppress(FileNotFoundError):
            (state_dir / "stack.json").unlink()
        return 0
    pid = int(stack["supervisor_pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _pid_alive(pid):
        time.sleep(0.1)
    if _pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
    print("torchrelay is down")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchrelay.stack")
    parser.add_argument("action", choices=["supervise"])
    parser.add_argument("--state-dir", default=None)
    args = parser.parse_args(argv)
    return supervise(state_dir_from(args.state_dir))


def cmd_service(args: argparse.Namespace) -> int:
    """``torchrelay service NAME [ARGS...]``: run one service as ``python -m services.NAME``
    with the services on its path (they ship inside torchrelay), in place of this process:
    a GPU node's ``torchrelay service detector agent --node N`` or a unit file's service."""
    if args.name not in SERVICES:
        print(
            f"torchrelay service: no service {args.name!r}; choose one of {', '.join(SERVICES)}",
            file=sys.stderr,
        )
        return 2
    if services_path() is None:
        print(
            "torchrelay service: the control plane is not installed here: "
            "pip install 'torchrelay[control-plane]'",
            file=sys.stderr,
        )
        return 2
    rest = list(args.args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    argv = [sys.executable, "-m", f"services.{args.name}", *rest]
    os.execve(sys.executable, argv, with_services_path(dict(os.environ)))  # noqa: S606
    return 0  # not reached: execve replaces this process


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
