"""The bench runner runs the benchmarks in a fixed order and refuses names it does not know."""

from __future__ import annotations

import json
import math

import pytest

from tests.bench.__main__ import _clean, discover, main


def test_measured_figures_come_first_so_goodput_reads_this_runs_stall() -> None:
    names = discover()
    assert names[:3] == ["migration", "goodput", "control_plane"]
    assert "__main__" not in names
    assert all(not n.startswith("_") for n in names)


def test_an_unknown_benchmark_is_refused_with_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no_such_bench"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark(s): no_such_bench" in err
    assert "goodput" in err


def test_results_are_valid_json_without_infinities() -> None:
    cleaned = _clean({"a": math.inf, "b": [1.0, math.nan], "c": {"d": 2}})
    assert json.loads(json.dumps(cleaned)) == {"a": None, "b": [1.0, None], "c": {"d": 2}}
