"""The checkpoint bench's arithmetic on made-up commit times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench import checkpoint


def _write(run_dir: Path, rank: int, gaps: list[float]) -> None:
    times = [0.0]
    for gap in gaps:
        times.append(times[-1] + gap)
    (run_dir / f"m{rank}.digest.json").write_text(json.dumps({"commit_times": times}))


def test_a_checkpoints_cost_is_its_windows_excess_over_the_windows_between(
    tmp_path: Path,
) -> None:
    gaps = [0.1] * (checkpoint.STEPS - 1)
    for k in range(checkpoint.EVERY, checkpoint.STEPS - checkpoint.WINDOW, checkpoint.EVERY):
        gaps[k] += 0.05  # the step after each checkpoint pays 50 ms
        gaps[k + checkpoint.EVERY // 2] += 0.01  # and some noise half-way between
    for rank in range(2):
        _write(tmp_path, rank, gaps)
    assert checkpoint.window_cost(tmp_path) == pytest.approx(0.04)
    # The mean step after warm-up counts the checkpoint steps too.
    assert checkpoint.mean_step(tmp_path) > 0.1
