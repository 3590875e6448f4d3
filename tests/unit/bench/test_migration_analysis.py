"""The migration bench reads stall and lost steps from the ranks' step logs as defined."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.migration import analyse


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
    stats = analyse(tmp_path, world=4, victim=2)
    assert stats.lost_steps == 1
    assert stats.committed == 10
    assert stats.stall_s == pytest.approx(2.5 + 0.05 - 0.45)


def test_a_rollback_counts_every_recomputed_step(tmp_path: Path) -> None:
    # checkpoint after step 3; killed during step 6: steps 4, 5 recomputed and 6 abandoned
    first = [*_steps(range(6), 0.0, 0.1), "begin 6 0.6"]
    again = _steps(range(4, 10), 10.0, 0.1)
    for rank in range(4):
        _write(tmp_path, rank, first + again)
    stats = analyse(tmp_path, world=4, victim=1)
    assert stats.lost_steps == 3
    assert stats.committed == 10


def test_a_missing_rank_log_is_an_error_that_names_it(tmp_path: Path) -> None:
    _write(tmp_path, 0, _steps(range(3), 0.0, 0.1))
    with pytest.raises(RuntimeError, match="rank 1 wrote no step log"):
        analyse(tmp_path, world=2, victim=-1)
