"""``torchrelay run`` across hosts: torchrun's flags become this host's plan, and every
mistake is named before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchrelay.cli import build_parser
from torchrelay.launcher import LauncherError, options_from_args
from torchrelay.launcher._hosts import parse_gpus
from torchrelay.launcher._setup import Options

CLAIM = "sixteen-chars-claim!"


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:4222")
    monkeypatch.setenv("TORCHRELAY_JOB_CLAIM", CLAIM)
    monkeypatch.setenv("TORCHRELAY_HOME", str(tmp_path / "home"))
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


def plan(script: str, *flags: str) -> Options:
    return options_from_args(build_parser().parse_args(["run", *flags, script]))


def test_a_worker_host_gets_its_ranks_and_devices(script: str) -> None:
    opts = plan(
        script,
        *("--nnodes", "3", "--node-rank", "1", "--nproc-per-node", "2", "--job-id", "j1"),
        *("--node-name", "gpu-b", "--gpus", "4,5", "--simulate-gpus"),
    )
    host = opts.host
    assert host is not None
    assert (host.nnodes, host.node_rank, host.nproc_per_node, host.node) == (3, 1, 2, "gpu-b")
    assert host.gpus == [4, 5]
    assert host.simulate_gpus
    assert not host.spare_host
    assert opts.nproc == 2
    assert opts.spares == 0
    assert opts.run_dir.name == host.token


def test_a_spare_host_runs_only_spares(script: str) -> None:
    opts = plan(script, "--spare", "--job-id", "j1", "--nproc-per-node", "3", "--node-name", "s")
    assert opts.host is not None
    assert opts.host.spare_host
    assert (opts.nproc, opts.spares) == (0, 3)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nnodes", "2", "--nproc-per-node", "2"], "needs --job-id"),
        (["--nnodes", "2", "--job-id", "j"], "--nproc-per-node must be given"),
        (["--nproc-per-node", "2", "--job-id", "j"], "--nnodes must be given"),
        (["--nnodes", "2", "--node-rank", "2", "--nproc-per-node", "1", "--job-id", "j"], "0..1"),
        (["--nproc", "2", "--nnodes", "2", "--nproc-per-node", "1", "--job-id", "j"], "shortcut"),
        (["--spare", "--nnodes", "2", "--nproc-per-node", "1", "--job-id", "j"], "takes no"),
        (["--nproc", "2", "--node-rank", "0"], "belongs to a job across hosts"),
        (["--nproc", "2", "--gpus", "0,1"], "belongs to a job across hosts"),
        (
            ["--nnodes", "1", "--nproc-per-node", "1", "--job-id", "j", "--node-name", "a b"],
            "--node-name",
        ),
        (["--nnodes", "1", "--nproc-per-node", "2", "--job-id", "j", "--gpus", "0"], "needs 2"),
    ],
)
def test_mistakes_are_named(script: str, flags: list[str], message: str) -> None:
    with pytest.raises(LauncherError, match=message):
        plan(script, *flags)


def test_a_job_id_too_long_for_this_hosts_ids_is_refused_before_anything_starts(
    script: str,
) -> None:
    flags = ["--nnodes", "1", "--nproc-per-node", "1", "--node-name", "n" * 48]
    plan(script, *flags, "--job-id", "j" * 70)  # 70 + len("-launcher-") + 48 = 128
    with pytest.raises(LauncherError, match=r"ids of 129 characters, over 128"):
        plan(script, *flags, "--job-id", "j" * 71)


def test_a_claim_of_the_wrong_length_is_refused(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHRELAY_JOB_CLAIM", "short")
    with pytest.raises(LauncherError, match="TORCHRELAY_JOB_CLAIM must be 16 to 256"):
        plan(script, "--nnodes", "1", "--nproc-per-node", "1", "--job-id", "j")


def test_gpus_are_distinct_device_indexes() -> None:
    assert parse_gpus(None, 3) == [0, 1, 2]
    assert parse_gpus("6,7,2,3", 3) == [6, 7, 2]
    for bad, message in (("0,x", "device indexes"), ("1,1", "distinct"), ("-1", "distinct")):
        with pytest.raises(LauncherError, match=message):
            parse_gpus(bad, 1)
