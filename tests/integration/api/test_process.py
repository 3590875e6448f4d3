"""``python -m services.api`` as its own process: start, bound port, refusals, SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx

from torchrelay.runtime import ServerProcess, free_port

TOKEN = "trdev_process-test-operator-token-0123456789"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRELAY_")}
    env.update(
        {
            "TORCHRELAY_LOG_JSON": "false",
            "TORCHRELAY_CONNECT_TIMEOUT_S": "2",
            "TORCHRELAY_HTTP_PORT": "0",
            **extra,
        }
    )
    return env


def test_serves_on_a_free_port_and_stops_on_sigterm(
    nats_proc: ServerProcess, redis_proc: ServerProcess
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.api"],
        env=_env(NATS_URL=nats_proc.url, REDIS_URL=redis_proc.url, TORCHRELAY_OPERATOR_TOKEN=TOKEN),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the process prints its bound port once listening
        assert line, proc.stderr.read() if proc.stderr else ""
        started = json.loads(line)
        assert started["http_port"] > 0
        url = started["api_url"]
        with httpx.Client(base_url=url, timeout=5) as http:
            assert http.get("/healthz").json() == {"status": "ok"}
            assert http.get("/readyz").status_code == 200
            assert http.get("/v1/jobs").status_code == 401
            r = http.post(
                "/v1/tokens",
                json={"scope": "tenant", "tenant": "acme"},
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            assert r.status_code == 201
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_unreachable_nats_exits_naming_nats_url(redis_proc: ServerProcess) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "services.api"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(NATS_URL=f"nats://127.0.0.1:{free_port()}", REDIS_URL=redis_proc.url),
        check=False,
    )
    assert result.returncode == 3
    assert "NATS_URL" in result.stderr
    assert time.monotonic() - started < 30


def test_production_refuses_a_development_operator_token(
    nats_proc: ServerProcess, redis_proc: ServerProcess
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.api"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(
            NATS_URL=nats_proc.url,
            REDIS_URL=redis_proc.url,
            TORCHRELAY_ENVIRONMENT="production",
            TORCHRELAY_OPERATOR_TOKEN=TOKEN,
        ),
        check=False,
    )
    assert result.returncode == 2
    assert "TORCHRELAY_OPERATOR_TOKEN" in result.stderr
    assert "development token" in result.stderr


# Blocks a module for the child process, as if it were not installed.
_WITHOUT = "import sys\nfor name in {names!r}:\n    sys.modules[name] = None\n"
_MAIN = "from services.api.__main__ import main\nmain()\n"


def _ready_line(stderr: str) -> dict[str, object]:
    for line in stderr.splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("msg") == "ready":
                return dict(record)
    raise AssertionError(f"no ready line in the log:\n{stderr[-2000:]}")


def _serve_and_stop(env: dict[str, str], without: tuple[str, ...] = ()) -> dict[str, object]:
    """Run the API process (with ``without`` modules missing), check it answers, stop it with
    SIGTERM; return its ready log record."""
    code = (_WITHOUT.format(names=without) if without else "") + _MAIN
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        url = json.loads(line)["api_url"]
        with httpx.Client(base_url=url, timeout=5) as http:
            assert http.get("/healthz").json() == {"status": "ok"}
            assert http.get("/v1/incidents").status_code == 401
            r = http.get("/v1/nodes", headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 503  # no detector behind this API: named, not a hang
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
        assert proc.returncode == 0, stderr
        return _ready_line(stderr)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _served_env(nats_proc: ServerProcess, redis_proc: ServerProcess) -> dict[str, str]:
    return _env(
        NATS_URL=nats_proc.url,
        REDIS_URL=redis_proc.url,
        TORCHRELAY_OPERATOR_TOKEN=TOKEN,
        TORCHRELAY_LOG_JSON="true",
        TORCHRELAY_RPC_TIMEOUT_S="0.5",
    )


def test_serves_on_uvloop_and_httptools_when_installed(
    nats_proc: ServerProcess, redis_proc: ServerProcess
) -> None:
    ready = _serve_and_stop(_served_env(nats_proc, redis_proc))
    assert (ready["loop"], ready["http"]) == ("uvloop", "httptools")


def test_falls_back_to_asyncio_and_h11_without_them(
    nats_proc: ServerProcess, redis_proc: ServerProcess
) -> None:
    ready = _serve_and_stop(_served_env(nats_proc, redis_proc), without=("uvloop", "httptools"))
    assert (ready["loop"], ready["http"]) == ("asyncio", "h11")
