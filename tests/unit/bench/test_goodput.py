"""The goodput simulator reproduces the paper's MTTF projection and its strategies' math holds."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.bench import goodput
from tests.bench.goodput import (
    DAY_S,
    HOUR_S,
    Costs,
    Policy,
    closed_form_ettr,
    measured_relay_stall,
    mttf_s,
    p_no_spare,
    policies_for,
    simulate,
    young_daly_interval_s,
)


@pytest.mark.parametrize(("gpus", "paper_h"), [(16_384, 1.8), (131_072, 0.23)])
def test_mttf_projection_matches_the_paper_within_5_percent(gpus: int, paper_h: float) -> None:
    assert mttf_s(gpus) / HOUR_S == pytest.approx(paper_h, rel=0.05)


def test_mttf_falls_as_one_over_nodes() -> None:
    assert mttf_s(1_024) == pytest.approx(2 * mttf_s(2_048))
    assert mttf_s(16_384) == pytest.approx(8 * mttf_s(131_072))


def test_young_daly_interval_is_near_the_best_interval() -> None:
    mttf = mttf_s(16_384)
    costs = Costs()
    base = policies_for(16_384, costs)["checkpoint_restart"]
    tau = young_daly_interval_s(costs.checkpoint_s, mttf)
    assert tau == pytest.approx(math.sqrt(2 * 60.0 * mttf))
    best = closed_form_ettr(base, mttf)
    for factor in (0.25, 0.5, 2.0, 4.0):
        other = replace(base, checkpoint_interval_s=tau * factor)
        assert closed_form_ettr(other, mttf) < best


@pytest.mark.parametrize("name", ["checkpoint_restart", "in_job_restart"])
def test_monte_carlo_agrees_with_the_closed_form(name: str) -> None:
    gpus = 131_072
    mttf = mttf_s(gpus)
    policy = policies_for(gpus, Costs())[name]
    rng = np.random.default_rng(7)
    horizon = 10 * DAY_S
    ettrs = [simulate(policy, gpus, horizon, rng, mttf).productive_s / horizon for _ in range(4)]
    assert float(np.mean(ettrs)) == pytest.approx(closed_form_ettr(policy, mttf), abs=0.01)


def test_live_recovery_with_unlimited_spares_costs_only_the_stall() -> None:
    mttf = 1_000.0
    policy = Policy("live", math.inf, 0.0, live_cost_s=5.0, restart_s=300.0)
    assert closed_form_ettr(policy, mttf) == pytest.approx(math.exp(-5.0 / mttf))
    rng = np.random.default_rng(3)
    horizon = 20 * DAY_S
    stats = simulate(policy, 8, horizon, rng, mttf)
    assert stats.fallbacks == 0
    assert stats.productive_s / horizon == pytest.approx(math.exp(-5.0 / mttf), abs=0.002)


def test_no_spare_probability_is_the_poisson_tail_for_unlimited_repair() -> None:
    # load 0.5 Erlang, one spare: blocked when at least one node is in repair
    assert p_no_spare(0.5, 1.0, 1) == pytest.approx(1 - math.exp(-0.5))
    assert p_no_spare(0.5, 1.0, 2) == pytest.approx(1 - math.exp(-0.5) * 1.5)
    assert p_no_spare(0.5, 1.0, 0) == 1.0


def test_finite_repair_crews_block_more_often_and_converge_to_unlimited() -> None:
    unlimited = p_no_spare(3.0, 1.0, 5)
    assert p_no_spare(3.0, 1.0, 5, crews=4) > unlimited
    assert p_no_spare(3.0, 1.0, 5, crews=60) == pytest.approx(unlimited, rel=1e-9)
    assert p_no_spare(3.0, 1.0, 5, crews=3) == 1.0  # unstable queue: repairs never catch up
    # M/M/1, spares beyond the crew: P(N >= s) = rho^s
    assert p_no_spare(0.5, 1.0, 3, crews=1) == pytest.approx(0.5**3)


def test_simulated_fallback_share_matches_the_no_spare_probability() -> None:
    gpus = 2_048
    costs = Costs()
    policy = policies_for(gpus, costs)["torchrelay"]
    mttf = mttf_s(gpus)
    assert policy.spares is not None
    expected = p_no_spare(1.0 / mttf, costs.mttr_s, policy.spares)
    rng = np.random.default_rng(11)
    runs = [simulate(policy, gpus, 120 * DAY_S, rng, mttf) for _ in range(6)]
    share = sum(r.fallbacks for r in runs) / sum(r.failures for r in runs)
    assert share == pytest.approx(expected, abs=0.06)


def test_torchrelay_beats_checkpoint_restart_at_scale_and_the_run_is_reproducible() -> None:
    costs = Costs()
    first = goodput.evaluate(costs, scales=(131_072,), replications=2, horizon_days=3)
    again = goodput.evaluate(costs, scales=(131_072,), replications=2, horizon_days=3)
    assert first == again
    s = first["131072"]["strategies"]
    assert s["torchrelay"]["ettr"] > s["in_job_restart"]["ettr"] > s["checkpoint_restart"]["ettr"]
    assert s["torchrelay"]["gpu_hours_saved_vs_checkpoint_restart"] > 0


def test_relay_stall_is_read_from_the_migration_bench_only_when_measured(tmp_path: Path) -> None:
    assert measured_relay_stall(tmp_path) is None
    (tmp_path / "migration.json").write_text(json.dumps({"systems": {"torchrelay": {}}}))
    assert measured_relay_stall(tmp_path) is None
    (tmp_path / "migration.json").write_text(
        json.dumps({"systems": {"torchrelay": {"stall_s": 0.25}}})
    )
    found = measured_relay_stall(tmp_path)
    assert found is not None
    assert found[0] == 0.25
    assert "measured" in found[1]
