"""The migration bench reads stall, largest gap and lost steps from the ranks' step logs as
defined."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.bench import migration
from tests.bench.migration import analyse


def _killed(log_dir: Path, at: float) -> None:
    """The victim's record of its kill (the workloads write ``<pid> <time>``)."""
    (log_dir / "killed").write_text(f"4242 {at:.6f}\n")


def _write(log_dir: Path, rank: int, lines: list[str], sha: str = "s") -> None:
    (log_dir / f"rank{rank}.log").write_text("\n".join(lines) + "\n")
    (log_dir / f"final{rank}.json").write_text(json.dumps({"sha256": sha}))


def _steps(steps: range, t0: float, dt: float) -> list[str]:
    out = []
    for i, s in enumerate(steps):
        out += [f"begin {s} {t0 + i * dt:.3f}", f"commit {s} {t0 + i * dt + dt / 2:.3f}"]
    return out


def test_a_step_abandoned_in_flight_counts_once_and_the_gap_is_the_stall(tmp_path: Path) -> None:
    # survivors: steps 0-4 every 0.1 s, step 5 begun and abandoned, then 5-9 after a 2 s gap
    survivor = [*_steps(range(5), 0.0, 0.1), "begin 5 0.5", *_steps(range(5, 10), 2.5, 0.1)]
    for rank in (0, 1, 3):
        _write(tmp_path, rank, survivor)
    _write(tmp_path, 2, [*_steps(range(5), 0.0, 0.1), "begin 5 0.5", "killed 5 0.51"])
    _killed(tmp_path, 0.51)
    stats = analyse(tmp_path, world=4, victim=2, kill_step=5)
    assert stats.lost_steps == 1
    assert stats.committed == 10
    assert stats.stall_s == pytest.approx(2.5 + 0.05 - 0.45)
    assert stats.max_gap_s == pytest.approx(stats.stall_s)


def test_the_stall_is_the_gap_of_the_interrupted_step_not_a_slow_step_elsewhere(
    tmp_path: Path,
) -> None:
    # commits every 0.1 s, except a 0.4 s step 2 (noise) and 0.3 s for step 4, the victim's
    # (rank 1) kill step: it died after committing step 3 -- on rank 3, whose optimizer step
    # was slow, the commit of step 3 is only written after the kill (0.72): still the gap
    # that counts is from its commit of step 3 to its next.
    times = [0.1, 0.2, 0.6, 0.7, 1.0, 1.1, 1.2]
    for rank in (0, 2):
        _write(tmp_path, rank, [f"commit {i} {t}" for i, t in enumerate(times)])
    late = [*times[:3], 0.74, 1.0, 1.1, 1.2]
    _write(tmp_path, 3, [f"commit {i} {t}" for i, t in enumerate(late)])
    _write(tmp_path, 1, [f"commit {i} {t}" for i, t in enumerate(times[:4])])
    _killed(tmp_path, 0.72)
    stats = analyse(tmp_path, world=4, victim=1, kill_step=4)
    assert stats.stall_s == pytest.approx(0.3)
    assert stats.max_gap_s == pytest.approx(0.4)
    clean = analyse(tmp_path, world=4, victim=-1)  # without a kill: the largest gap is all
    assert clean.stall_s == clean.max_gap_s == pytest.approx(0.4)


def test_a_kill_without_its_record_is_an_error(tmp_path: Path) -> None:
    for rank in range(2):
        _write(tmp_path, rank, _steps(range(3), 0.0, 0.1))
    with pytest.raises(RuntimeError, match="rank 1 was to be killed"):
        analyse(tmp_path, world=2, victim=1)


def test_a_rollback_counts_every_recomputed_step(tmp_path: Path) -> None:
    # checkpoint after step 3; killed during step 6: steps 4, 5 recomputed and 6 abandoned
    first = [*_steps(range(6), 0.0, 0.1), "begin 6 0.6"]
    again = _steps(range(4, 10), 10.0, 0.1)
    for rank in range(4):
        _write(tmp_path, rank, first + again)
    _killed(tmp_path, 0.65)
    stats = analyse(tmp_path, world=4, victim=1, kill_step=6)
    assert stats.stall_s == pytest.approx(10.05 - 0.55)  # step 5's commit to step 4's again
    assert stats.lost_steps == 3
    assert stats.committed == 10


def test_a_missing_rank_log_is_an_error_that_names_it(tmp_path: Path) -> None:
    _write(tmp_path, 0, _steps(range(3), 0.0, 0.1))
    with pytest.raises(RuntimeError, match="rank 1 wrote no step log"):
        analyse(tmp_path, world=2, victim=-1)


def test_the_bench_reports_the_median_stall_of_its_runs_and_every_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migration, "STEPS", 8)
    monkeypatch.setattr(migration, "KILL_STEP", 4)
    # A stand-in system: its runs with the kill stall 0.5, 0.2, 0.3 s; the second ends in a
    # different state.
    stalls = iter([0.5, 0.2, 0.3])
    shas = iter(["good", "bad", "good"])

    def runner(work: Path, fault: bool) -> tuple[float, Path, dict[str, Any]]:
        work.mkdir(parents=True)
        gap = next(stalls) if fault else 0.1
        sha = next(shas) if fault else "good"
        times = [0.1 * i for i in range(1, 5)] + [0.4 + gap + 0.1 * i for i in range(4)]
        for rank in range(4):
            lines = [f"commit {i} {t:.3f}" for i, t in enumerate(times)]
            if fault and rank == 2:
                lines = [*lines[:4], "killed 4 0.45"]
            _write(work, rank, lines, sha)
        if fault:
            _killed(work, 0.45)
        return 10.0 if fault else 9.0, work, {}

    figures = migration._measure("stand-in", runner, tmp_path, fault_runs=3)
    assert figures["stall_runs_s"] == pytest.approx([0.5, 0.2, 0.3])
    assert figures["stall_s"] == pytest.approx(0.3)
    assert figures["clean_max_gap_s"] == pytest.approx(0.1)
    assert figures["equal_final"] is False  # one run ended elsewhere: not equal
    assert figures["final_sha256_rank0"] == {"clean": "good", "fault": ["good", "bad", "good"]}


@pytest.mark.parametrize("raw", ["0", "-2", "three", ""])
def test_a_bad_number_of_runs_is_refused_naming_the_setting(raw: str) -> None:
    with pytest.raises(ValueError, match="TORCHRELAY_BENCH_FAULT_RUNS must be a whole number"):
        migration.fault_runs_from({"TORCHRELAY_BENCH_FAULT_RUNS": raw})
    assert migration.fault_runs_from({}) == 3
    assert migration.fault_runs_from({"TORCHRELAY_BENCH_FAULT_RUNS": "5"}) == 5
