"""Hosts on one machine: a Linux network namespace per host, veth pairs on one bridge
(``torchrelay demo --hosts``, the multi-host tests and bench).

The control plane runs in the machine's own namespace, listening on the bridge's address;
each host reaches it, and the other hosts, only over its veth link. Host loss is a SIGKILL
of every process in a host's namespace; a partition is its link set down. Creating them
needs root and ``ip`` (iproute2): :func:`unavailable` says why they cannot be made.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

SUBNET = "10.213.{net}"


class NetworkError(RuntimeError):
    """An ``ip`` command that builds or changes the hosts' network failed; names it."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and done.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)} failed: {done.stderr.strip() or done.returncode}")
    return done


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"trprobe{os.getpid() % 100000}"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip()}"
        link = _ip("link", "add", f"{probe}b", "type", "bridge", check=False)
        if link.returncode != 0:
            return f"ip link add type bridge failed: {link.stderr.strip()}"
        return None
    finally:
        _ip("link", "del", f"{probe}b", check=False)
        _ip("netns", "del", probe, check=False)


@dataclass
class Host:
    """One host: its namespace, its address on the bridge and its link's outer end."""

    name: str
    netns: str
    address: str
    outer: str  # the veth end on the bridge, in the machine's namespace


@dataclass
class Network:
    """A bridge and its hosts; :meth:`close` kills what they run and removes everything."""

    tag: str
    bridge: str
    gateway: str
    hosts: dict[str, Host] = field(default_factory=dict)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 10
        netns = f"{self.tag}-{name}"
        outer = f"{self.tag}{index}"
        address = self.gateway.rsplit(".", 1)[0] + f".{index}"
        _ip("netns", "add", netns)
        host = Host(name, netns, address, outer)
        self.hosts[name] = host  # registered first: close() removes a half-made host too
        _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("link", "set", outer, "master", self.bridge, "up")
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        return host

    def spawn(
        self, host: str, cmd: list[str], env: dict[str, str], log: IO[bytes]
    ) -> subprocess.Popen[bytes]:
        """Run ``cmd`` inside ``host``'s namespace (its own session, so signals stay its)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[host].netns, *cmd],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    def pids(self, host: str) -> list[int]:
        out = _ip("netns", "pids", self.hosts[host].netns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process of ``host`` at once (a host lost with its power)."""
        killed = self.pids(host)
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return killed

    def partition(self, host: str) -> None:
        """Cut ``host`` off the network: its processes run on, nothing reaches them."""
        _ip("link", "set", self.hosts[host].outer, "down")

    def heal(self, host: str) -> None:
        _ip("link", "set", self.hosts[host].outer, "up")

    def close(self) -> None:
        for name in list(self.hosts):
            self.kill_host(name)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        deadline = time.monotonic() + 10
        for name in list(self.hosts):
            while self.pids(name) and time.monotonic() < deadline:
                self.kill_host(name)
                time.sleep(0.1)
        for host in self.hosts.values():
            _ip("link", "del", host.outer, check=False)
            _ip("netns", "del", host.netns, check=False)
        _ip("link", "del", self.bridge, check=False)


@contextlib.contextmanager
def network(names: list[str], net: int | None = None) -> Iterator[Network]:
    """A bridge with one namespace per name; everything is removed on the way out."""
    net = net if net is not None else 100 + os.getpid() % 150
    tag = f"tr{net}"
    gateway = SUBNET.format(net=net) + ".1"
    bridge = f"{tag}br"
    _ip("link", "del", bridge, check=False)  # left over by a run that was killed
    for leftover in _ip("netns", "list", check=False).stdout.split("\n"):
        if leftover.startswith(f"{tag}-"):
            _ip("netns", "del", leftover.split()[0], check=False)
    _ip("link", "add", bridge, "type", "bridge")
    nw = Network(tag, bridge, gateway)
    try:
        _ip("addr", "add", f"{gateway}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for name in names:
            nw.add_host(name)
        yield nw
    finally:
        nw.close()


def read_log(path: Path, tail: int = 3000) -> str:
    return path.read_text(errors="replace")[-tail:] if path.exists() else f"({path} missing)"
