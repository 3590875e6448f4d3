"""A training script of a job tries to read every secret of its stack.

It is the customer's code: it gets its job credential and nothing else. Its environment
names nothing of the stack's; the stack's files are private to the stack's user (state
directory 0700, every secret 0600); and under ``torchrelay run --run-as USER`` the script
cannot read any of them even knowing where they are.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Stack, start_stack, stop_stack
from torchrelay.launcher import STACK_ONLY_ENV

SNOOP = """
import json, os, sys
from pathlib import Path
state, out = Path(sys.argv[1]), Path(sys.argv[2])
read, refused = [], []
for path in sorted(state.rglob("*")) if os.access(state, os.X_OK) else [state]:
    try:
        if path.is_file():
            path.read_bytes()
            read.append(str(path))
    except OSError:
        refused.append(str(path))
stack_json = state / "stack.json"
try:
    stack_json.read_text()
    read.append(str(stack_json))
except OSError:
    refused.append(str(stack_json))
out.write_text(json.dumps({
    "env": sorted(os.environ),
    "read": read,
    "refused": refused,
    "cred": os.environ.get("TORCHRELAY_NATS_CREDENTIALS"),
    "cred_text": Path(os.environ["TORCHRELAY_NATS_CREDENTIALS"]).read_text()
    if os.environ.get("TORCHRELAY_NATS_CREDENTIALS") else "",
}))
"""


def _snoop(stack: Stack, tmp_path: Path, *extra: str) -> dict[str, object]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "snoop.py"
    script.write_text(SNOOP)
    out = tmp_path / "snooped.json"
    tmp_path.chmod(0o777)  # the report is written by the training user
    job = f"snoop-{len(extra)}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchrelay.cli",
            "run",
            "--nproc",
            "1",
            "--spares",
            "0",
            "--job-id",
            job,
            "--no-node-agents",
            *extra,
            str(script),
            "--",
            str(stack.state_dir),
            str(out),
        ],
        env=stack.env(TORCHRELAY_NATS_CREDENTIALS=stack.info["credentials"]["launcher"]),
        capture_output=True,
        text=True,
        timeout=120,
    )
    # The script never joins the job (it is not a training loop): the launcher says the job
    # ended early, which is beside the point here; its report is.
    assert out.exists(), proc.stderr[-3000:]
    data: dict[str, object] = json.loads(out.read_text())
    return data


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_training_process_gets_its_job_credential_and_nothing_else(
    stack: Stack, tmp_path: Path
) -> None:
    seen = _snoop(stack, tmp_path)
    env = set(seen["env"])  # type: ignore[arg-type]
    assert not env & STACK_ONLY_ENV - {"TORCHRELAY_NATS_CREDENTIALS"}
    assert str(seen["cred_text"]).startswith("job.snoop-0:")
    # Private to the stack's user: only that user (and root) can open these.
    state = stack.state_dir
    assert _mode(state) == 0o700
    assert _mode(state / "nats") == 0o700
    assert _mode(state / "redis") == 0o700
    assert _mode(state / "nats" / "nats.conf") == 0o600
    assert _mode(state / "stack.json") == 0o600
    auth = state / "auth"
    assert _mode(auth) == 0o700
    for path in auth.rglob("*"):
        assert _mode(path) == (0o700 if path.is_dir() else 0o600), path


def _python_for(user: str) -> str | None:
    """An interpreter ``user`` can run (the snooping script needs only the standard library):
    this one, else the system's. CI's own lives under the 0700 ``/root``."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if not Path(candidate).exists():
            continue
        try:
            subprocess.run([candidate, "-c", "0"], user=user, check=True, timeout=30)
        except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
            continue
        return candidate
    return None


@pytest.fixture(scope="module")
def open_stack() -> Iterator[Stack]:
    """A stack whose state dir sits in a directory every user may traverse, so only the
    state dir's own mode keeps another user out (the session stack's parents are 0700)."""
    base = Path(tempfile.mkdtemp(prefix="tr-secrets-"))
    base.chmod(0o755)
    stack = start_stack(base / "state")
    try:
        yield stack
    finally:
        stop_stack(stack)
        shutil.rmtree(base, ignore_errors=True)


def test_run_as_keeps_every_secret_from_the_training_code(open_stack: Stack) -> None:
    if os.geteuid() != 0:
        pytest.skip("--run-as needs torchrelay run to be started as root")
    python = _python_for("nobody")
    if python is None:
        pytest.skip("no Python interpreter here that the user nobody may run")
    work = Path(tempfile.mkdtemp(prefix="tr-snoop-"))
    try:
        work.chmod(0o777)
        # As root (the launcher's user) the same script reads them all: the check can fail.
        as_root = _snoop(open_stack, work / "root", "--python", python)
        secrets_ = [p for p in as_root["read"] if "/auth/" in p]  # type: ignore[union-attr]
        assert secrets_, as_root
        seen = _snoop(open_stack, work / "nobody", "--run-as", "nobody", "--python", python)
        assert seen["read"] == []
        assert seen["refused"]  # it tried, and the kernel said no
        assert str(seen["cred_text"]).startswith("job.snoop-4:")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_run_as_refuses_what_it_cannot_do(stack: Stack, tmp_path: Path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("")
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "torchrelay.cli", "run", "--nproc", "1", "--spares", "0"),
            *("--run-as", "no-such-user-here", str(script)),
        ],
        env=stack.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "--run-as no-such-user-here: no such user" in proc.stderr
