"""The whole deployment on this machine for e2e and chaos tests: both servers and the six
services as processes (the supervisor of ``torchrelay up``), and jobs run with ``torchrelay run``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

EXAMPLE = Path(__file__).resolve().parents[1] / "libs" / "torchrelay" / "examples" / "train_mlp.py"


@dataclass
class Stack:
    """A running stack: its URLs, operator token, state dir and supervisor process."""

    state_dir: Path
    info: dict[str, Any]
    proc: subprocess.Popen[bytes]

    @property
    def nats_url(self) -> str:
        """The URL for the test process itself: with the stack's break-glass ``admin`` user
        in it when authentication is on (tests that replay or forge events on purpose).
        Processes the tests start get the plain URL and find their own role's credential
        in ``stack.json`` (:meth:`env`)."""
        return self.url_as("admin")

    @property
    def plain_nats_url(self) -> str:
        return str(self.info["nats_url"])

    def url_as(self, role: str) -> str:
        """The NATS URL with ``role``'s user and password (the plain URL without auth)."""
        url = self.plain_nats_url
        cred = (self.info.get("credentials") or {}).get(role)
        if not cred:
            return url
        user, _, password = Path(cred).read_text().strip().partition(":")
        scheme, _, rest = url.partition("://")
        return f"{scheme}://{user}:{password}@{rest}"

    @property
    def api_url(self) -> str:
        return str(self.info["api_url"])

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "NATS_URL": self.plain_nats_url,
                "REDIS_URL": str(self.info["redis_url"]),
                "TORCHRELAY_HOME": str(self.state_dir),
                "PYTHONUNBUFFERED": "1",
                "TORCHRELAY_API_URL": self.api_url,
                "TORCHRELAY_TOKEN": str(self.info["operator_token"]),
            }
        )
        env.update(extra)
        return env

    def api(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.api_url,
            timeout=10.0,
            headers={"Authorization": f"Bearer {self.info['operator_token']}"},
        )

    def reload(self) -> None:
        self.info = json.loads((self.state_dir / "stack.json").read_text())

    def traces(self) -> list[dict[str, Any]]:
        path = self.state_dir / "traces.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def start_stack(state_dir: Path, env_extra: dict[str, str] | None = None) -> Stack:
    """Start a supervised stack in ``state_dir``; ``env_extra`` reaches every service."""
    state_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    for var in ("NATS_URL", "REDIS_URL", "TORCHRELAY_NATS_CREDENTIALS", "TORCHRELAY_AUTH_DIR"):
        env.pop(var, None)
    env.update(env_extra or {})
    env["TORCHRELAY_TRACE_FILE"] = str(state_dir / "traces.jsonl")
    env["TORCHRELAY_LOG_LEVEL"] = "INFO"
    log = (state_dir / "supervisor.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchrelay.stack", "supervise", "--state-dir", str(state_dir)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"stack exited {proc.returncode}: "
                f"{(state_dir / 'supervisor.log').read_text()[-3000:]}"
            )
        path = state_dir / "stack.json"
        if path.exists():
            return Stack(state_dir, json.loads(path.read_text()), proc)
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("stack not ready within 120 s")


def stop_stack(stack: Stack) -> None:
    if stack.proc.poll() is None:
        stack.proc.send_signal(signal.SIGTERM)
        try:
            stack.proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(stack.proc.pid, signal.SIGKILL)
            stack.proc.wait()


def run_command(
    job_id: str, plan: list[str], steps: int, out: Path, extra: list[str] | None = None
) -> list[str]:
    """``torchrelay run PLAN`` of the example script for tenant ``acme``: ``plan`` is the
    launcher's flags (one host's shortcut, or a host of a job across hosts), ``extra`` the
    script's."""
    return [
        *(sys.executable, "-m", "torchrelay.cli", "run", *plan),
        *("--job-id", job_id, "--tenant", "acme", str(EXAMPLE)),
        *("--steps", str(steps), "--out", str(out), "--hidden", "256", *(extra or [])),
    ]


def run_job(
    stack: Stack,
    job_id: str,
    *,
    nproc: int,
    spares: int,
    steps: int,
    out: Path,
    nodes: int = 1,
    policy: str = "wait",
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
    run_args: list[str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``torchrelay run`` of the example script; the caller waits on it.

    ``extra`` goes to the script, ``run_args`` to ``torchrelay run`` (e.g. ``--wait-timeout``).
    """
    plan = ["--nproc", str(nproc), "--spares", str(spares), "--nodes", str(nodes)]
    plan += ["--policy", policy, *(run_args or [])]
    cmd = run_command(job_id, plan, steps, out, extra)
    log = (out.parent / f"{job_id}.log").open("ab")
    return subprocess.Popen(cmd, env=stack.env(**(env or {})), stdout=log, stderr=subprocess.STDOUT)


def digests(out: Path) -> dict[int, str]:
    """rank → sha256 of the final state written by the example script."""
    return {
        json.loads(p.read_text())["rank"]: json.loads(p.read_text())["sha256"]
        for p in sorted(out.glob("rank*.json"))
    }


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
