"""Launcher and chaos rules: exits, slots, where NATS is, argument errors."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from torchrelay.chaos import cmd_chaos, elsewhere, node_request
from torchrelay.cli import build_parser
from torchrelay.contract import Role
from torchrelay.launcher import (
    STACK_ONLY_ENV,
    Child,
    Launcher,
    LauncherError,
    classify_exit,
    cmd_run,
    describe_exit,
    options_from_args,
    prepare_run_dir,
    resolve_nats_url,
    slot_of,
    with_process_defaults,
)
from torchrelay.runtime import machine_id


def test_exit_codes_say_what_happened() -> None:
    record = {"kind": "application_error", "error": "Traceback..."}
    assert classify_exit(0, None) == "finished"
    assert classify_exit(75, None) == "fenced"
    assert classify_exit(1, record) == "application_error"
    assert classify_exit(1, None) == "lost"  # no exit record: not the user's exception
    assert classify_exit(-9, None) == "lost"
    # Killed on its way out after job.finish(): training was complete, nothing to migrate.
    assert classify_exit(-9, {"kind": "finished", "step": 99}) == "finished"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(3) == "exit code 3"


def test_children_get_huge_page_allocations_unless_the_user_chose() -> None:
    assert with_process_defaults({"A": "1"}) == {"A": "1", "THP_MEM_ALLOC_ENABLE": "1"}
    assert with_process_defaults({"THP_MEM_ALLOC_ENABLE": "0"})["THP_MEM_ALLOC_ENABLE"] == "0"


def test_slots_spread_round_robin_over_nodes() -> None:
    assert [slot_of(i, 2, "local") for i in range(5)] == [
        ("local-0", 0),
        ("local-1", 0),
        ("local-0", 1),
        ("local-1", 1),
        ("local-0", 2),
    ]


def test_nats_url_from_env_then_stack_file(tmp_path: Path) -> None:
    assert resolve_nats_url({"NATS_URL": "nats://a:1"}) == "nats://a:1"
    (tmp_path / "stack.json").write_text(json.dumps({"nats_url": "nats://b:2"}))
    assert resolve_nats_url({"TORCHRELAY_HOME": str(tmp_path)}) == "nats://b:2"
    with pytest.raises(LauncherError, match="torchrelay up --detach"):
        resolve_nats_url({"TORCHRELAY_HOME": str(tmp_path / "none")})


def test_run_without_a_stack_exits_2_with_a_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("NATS_URL", raising=False)
    monkeypatch.setenv("TORCHRELAY_HOME", str(tmp_path))
    script = tmp_path / "train.py"
    script.write_text("")
    args = build_parser().parse_args(["run", "--nproc", "2", str(script)])
    assert cmd_run(args) == 2
    assert (
        "no torchrelay stack: run `torchrelay up --detach` or set NATS_URL"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--nproc", "0", "x.py"], "--nproc"),
        (["run", "--nproc", "1", "--job-id", "bad id", "x.py"], "--job-id"),
        (["run", "--nproc", "1", "missing.py"], "does not exist"),
        (["run", "--nproc", "1", "--verify-every", "-1", "x.py"], "--verify-every must be >= 0"),
    ],
)
def test_bad_run_arguments_exit_2(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:1")
    assert cmd_run(build_parser().parse_args(argv)) == 2
    assert message in capsys.readouterr().err


def test_chaos_signals_only_processes_of_this_machine() -> None:
    here = {"member_id": "j-w1", "pid": 4242, "node": "gpu-a", "machine": machine_id()}
    assert elsewhere(here) is None
    there = {**here, "node": "gpu-b", "machine": "another-boot-id"}
    assert elsewhere(there) == "j-w1 runs on host gpu-b, another machine: run this command there"


def test_chaos_needs_a_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_chaos(build_parser().parse_args(["chaos", "kill", "--job", "j"])) == 2
    assert "--job ID --rank R" in capsys.readouterr().err
    assert cmd_chaos(build_parser().parse_args(["chaos", "xid", "--code", "79"])) == 2
    assert "--node N" in capsys.readouterr().err


def test_node_faults_are_forwarded_as_simulator_requests() -> None:
    args = argparse.Namespace(fault="xid", gpu=3, code=79, factor=None, duration=None)
    assert node_request(args) == {
        "fault": "xid",
        "gpu": 3,
        "code": 79,
        "factor": None,
        "duration": None,
    }


def test_verify_every_reaches_every_process_of_the_job(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:1")
    argv = ["run", "--nproc", "1", "--verify-every", "50", "x.py"]
    opts = options_from_args(build_parser().parse_args(argv))
    assert opts.extra_env == {"TORCHRELAY_VERIFY_EVERY": "50"}
    plain = options_from_args(build_parser().parse_args(["run", "--nproc", "1", "x.py"]))
    assert plain.extra_env == {}


@pytest.fixture
def run_opts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[..., Any]:
    """``torchrelay run --nproc 1 EXTRA x.py``'s options, in a folder holding ``x.py``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:1")

    def opts(*extra: str) -> Any:
        return options_from_args(build_parser().parse_args(["run", "--nproc", "1", *extra, "x.py"]))

    return opts


def test_checkpoint_flags_reach_every_process_and_bad_ones_are_named(
    run_opts: Callable[..., Any], tmp_path: Path
) -> None:
    opts = run_opts
    got = opts("--checkpoint-dir", "ck", "--checkpoint-every", "10", "--max-restarts", "5")
    assert got.checkpoint_dir == tmp_path / "ck"
    assert got.checkpoint_dir.is_dir()
    assert got.max_restarts == 5
    assert got.extra_env == {
        "TORCHRELAY_CHECKPOINT_DIR": str(tmp_path / "ck"),
        "TORCHRELAY_CHECKPOINT_EVERY": "10",
    }
    assert got.checkpoint_every == 10  # registered with the job: goodput's counterfactual
    assert opts().checkpoint_dir is None
    assert opts().checkpoint_every is None
    with pytest.raises(LauncherError, match="--checkpoint-dir needs --checkpoint-every N"):
        opts("--checkpoint-dir", "ck")
    with pytest.raises(LauncherError, match="need --checkpoint-dir"):
        opts("--checkpoint-every", "10")
    with pytest.raises(LauncherError, match="--checkpoint-keep must be at least 1"):
        opts("--checkpoint-dir", "ck", "--checkpoint-every", "10", "--checkpoint-keep", "0")
    timed = opts("--checkpoint-dir", "ck", "--checkpoint-every-s", "90")
    assert timed.extra_env["TORCHRELAY_CHECKPOINT_EVERY_S"] == "90.0"
    assert "TORCHRELAY_CHECKPOINT_EVERY" not in timed.extra_env
    with pytest.raises(LauncherError, match=r"--checkpoint-every-s -1\.0: give a number"):
        opts("--checkpoint-dir", "ck", "--checkpoint-every-s", "-1")
    with pytest.raises(LauncherError, match="--checkpoint-every 0: give N >= 1"):
        opts("--checkpoint-dir", "ck", "--checkpoint-every", "0")
    with pytest.raises(LauncherError, match="--max-restarts must be a whole number >= 0"):
        opts("--max-restarts", "-1")
    (tmp_path / "file").write_text("")
    with pytest.raises(LauncherError, match="--checkpoint-dir file/sub"):
        opts("--checkpoint-dir", "file/sub", "--checkpoint-every", "10")


def test_run_as_and_python_name_what_is_wrong(run_opts: Callable[..., Any]) -> None:
    opts = run_opts
    with pytest.raises(LauncherError, match="--python /no/such/python: not an executable"):
        opts("--python", "/no/such/python")
    with pytest.raises(LauncherError, match="--run-as no-such-user-x: no such user"):
        opts("--run-as", "no-such-user-x")
    if os.geteuid() == 0:
        with pytest.raises(LauncherError, match="--run-as root: the training code must not run"):
            opts("--run-as", "root")
    else:
        with pytest.raises(LauncherError, match="needs torchrelay run to be started as root"):
            opts("--run-as", "nobody")
    plain = opts()
    assert plain.run_as is None
    assert plain.python == sys.executable


def test_a_training_process_env_has_nothing_of_the_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:1")
    for name in STACK_ONLY_ENV:
        monkeypatch.setenv(name, "secret")
    launcher = Launcher(
        options_from_args(build_parser().parse_args(["run", "--nproc", "1", "x.py"]))
    )
    env = launcher._env(Child("job-w0", Role.WORKER, "local-0", 0))
    assert not set(env) & STACK_ONLY_ENV


def test_dash_m_runs_a_module_as_torchrun_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:1")
    argv = ["run", "--nproc", "4", "--spares", "2", "-m", "torchrelay.examples.train_mlp"]
    opts = options_from_args(build_parser().parse_args([*argv, "--", "--steps", "200"]))
    assert opts.module
    assert opts.script == "torchrelay.examples.train_mlp"
    assert opts.script_args == ["--steps", "200"]
    with pytest.raises(LauncherError, match="-m no_such_module_here: no such module"):
        options_from_args(
            build_parser().parse_args(["run", "--nproc", "1", "-m", "no_such_module_here"])
        )


def test_the_run_dir_under_run_as_refuses_planted_links(tmp_path: Path) -> None:
    plain = tmp_path / "plain" / "job"
    prepare_run_dir(plain, None)
    assert plain.stat().st_mode & 0o777 == 0o700
    if os.geteuid() != 0:
        pytest.skip("--run-as runs as root only")
    nobody = (65534, 65534)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "job").symlink_to(elsewhere)
    with pytest.raises(LauncherError, match="is a symbolic link"):
        prepare_run_dir(runs / "job", nobody)
    linked = tmp_path / "linked-runs"
    linked.symlink_to(elsewhere)
    with pytest.raises(LauncherError, match="must be a directory of root's"):
        prepare_run_dir(linked / "job", nobody)
    assert elsewhere.stat().st_uid == 0  # nothing was chowned through a link
    prepare_run_dir(runs / "job2", nobody)
    assert (runs / "job2").stat().st_uid == 65534
