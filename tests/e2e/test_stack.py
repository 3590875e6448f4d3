"""``torchrelay up --detach`` supervises its services: a killed one is back and ready fast."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from torchrelay.contract import SERVICES

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
            return int(resp.status) == 200
    except OSError:
        return False


def _cli(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL")}
    return subprocess.run(
        [sys.executable, "-m", "torchrelay.cli", *args, "--state-dir", str(state)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_up_detach_restarts_a_killed_service_within_10_seconds(tmp_path: Path) -> None:
    state = tmp_path / "stack"
    up = _cli(state, "up", "--detach")
    assert up.returncode == 0, up.stderr
    try:
        stack = json.loads((state / "stack.json").read_text())
        assert set(stack["services"]) == set(SERVICES)
        assert stack["operator_token"].startswith("trdev_")
        for name in ("scheduler", "migration_executor", "api"):
            svc = stack["services"][name]
            os.kill(svc["pid"], signal.SIGKILL)
            killed_at = time.monotonic()
            deadline = killed_at + 10.0
            back = False
            while time.monotonic() < deadline:
                current = json.loads((state / "stack.json").read_text())["services"][name]
                if current["pid"] != svc["pid"] and _ready(svc["port"]):
                    back = True
                    break
                time.sleep(0.1)
            assert back, f"{name} not back and ready within 10 s of kill -9"
            assert current["restarts"] >= 1
        log = (state / "supervisor.log").read_text()
        assert "restarting" in log  # every restart is logged
    finally:
        down = _cli(state, "down")
        assert down.returncode == 0, down.stderr
    assert not (state / "stack.json").exists()
