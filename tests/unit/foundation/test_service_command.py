"""``torchrelay service NAME``: a service run from anywhere (the services ship inside
torchrelay), and an installed torchrelay's services folder kept off training processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchrelay import runtime
from torchrelay.cli import build_parser
from torchrelay.contract import Role
from torchrelay.launcher import Child, Launcher, options_from_args


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", "torchrelay.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_service_runs_from_outside_the_source_tree(tmp_path: Path) -> None:
    done = _cli("service", "detector", "agent", "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--node" in done.stdout


def test_an_unknown_service_is_named_with_the_choices(tmp_path: Path) -> None:
    done = _cli("service", "detectr", cwd=tmp_path)
    assert done.returncode == 2
    assert "no service 'detectr'; choose one of detector, scheduler" in done.stderr


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed torchrelay's services folder, as :func:`runtime.services_path` finds it."""
    folder = tmp_path / "site" / "torchrelay" / "_control_plane"
    folder.mkdir(parents=True)
    monkeypatch.setattr(runtime, "services_path", lambda: folder)
    return folder


def test_training_processes_lose_only_an_installed_services_folder(
    installed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(installed), "/user/lib"]), "HOME": "/h"}
    assert runtime.without_installed_services(env) == {"PYTHONPATH": "/user/lib", "HOME": "/h"}
    assert runtime.without_installed_services({"PYTHONPATH": str(installed)}) == {}
    # A source checkout's root is left alone: a user may have it on the path on purpose.
    monkeypatch.setattr(runtime, "services_path", lambda: tmp_path)
    assert runtime.without_installed_services({"PYTHONPATH": str(tmp_path)}) == {
        "PYTHONPATH": str(tmp_path)
    }


def test_the_launcher_keeps_the_installed_services_off_its_training_processes(
    installed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(installed), "/user/lib"]))
    launcher = Launcher(
        options_from_args(build_parser().parse_args(["run", "--nproc", "1", "x.py"]))
    )
    env = launcher._env(Child("job-w0", Role.WORKER, "local-0", 0))
    assert env["PYTHONPATH"] == "/user/lib"
