"""Each service runs alone as its own process against the real servers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from torchrelay.contract import SERVICES
from torchrelay.runtime import free_port

pytestmark = pytest.mark.slow


def _env(nats_url: str, redis_url: str, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "NATS_URL": nats_url,
            "REDIS_URL": redis_url,
            "TORCHRELAY_HTTP_PORT": str(port),
            "TORCHRELAY_CONNECT_TIMEOUT_S": "2",
            "TORCHRELAY_ENVIRONMENT": "test",
            "TORCHRELAY_OPERATOR_TOKEN": "trtest_" + "x" * 32,
        }
    )
    return env


def _get(port: int, path: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return int(resp.status), json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {}


@pytest.mark.parametrize("service", SERVICES)
def test_service_starts_answers_readyz_and_stops_on_sigterm(
    service: str, nats_url: str, redis_url: str
) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", f"services.{service}"],
        env=_env(nats_url, redis_url, port),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        status = 0
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]  # type: ignore[union-attr]
            try:
                status, _ = _get(port, "/readyz")
            except OSError:
                status = 0
            if status == 200:
                break
            time.sleep(0.1)
        assert status == 200
        assert _get(port, "/healthz")[0] == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            assert resp.status == 200
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        assert time.monotonic() - started < 5.0
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("service", SERVICES)
def test_unreachable_nats_exits_nonzero_naming_the_setting(service: str, redis_url: str) -> None:
    port = free_port()
    dead = f"nats://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", f"services.{service}"],
        env=_env(dead, redis_url, port),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "NATS_URL" in proc.stderr


@pytest.mark.parametrize("service", SERVICES)
def test_malformed_redis_url_exits_nonzero_naming_the_setting(service: str, nats_url: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", f"services.{service}"],
        env=_env(nats_url, "redis//oops", free_port()),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "REDIS_URL" in proc.stderr
