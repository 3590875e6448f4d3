"""Goodput's arithmetic on hand-made jobs: the figures add up and each one is what it says."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from torchrelay.goodput import (
    Assumptions,
    GenerationSpan,
    Goodput,
    IncidentFacts,
    JobFacts,
    job_goodput,
    money_minor,
    price_for,
    term_window,
)

T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
RESTART = Assumptions(checkpoint_every=100, restart_s=60.0, price_per_gpu_hour_minor=250)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def adds_up(g: Goodput) -> None:
    """allocated = progress + each incident's lost time, to the millisecond."""
    parts = g.gpu_seconds_progress + sum(i.gpu_seconds_lost for i in g.incidents)
    assert abs(g.gpu_seconds_allocated - parts) < 0.0015
    assert g.gpu_seconds_lost == pytest.approx(sum(i.gpu_seconds_lost for i in g.incidents))


# 4 ranks for 1000 s: a live migration at 98 s (generation 2 at 100 s), a checkpoint restart
# at 400 s whose restarted job stepped at 505 s (generation 3 at 500 s), a drain at 700 s.
JOB = JobFacts(
    job_id="j1",
    tenant="acme",
    generations=(
        GenerationSpan(1, at(0), 4),
        GenerationSpan(2, at(100), 4),
        GenerationSpan(3, at(500), 4),
    ),
    end=at(1000),
    committed_step=1700,
    step_time_s=0.5,
)
LIVE = IncidentFacts("i-live", "migrated_live", at(98), 2000.0, 1, 1)
RESTARTED = IncidentFacts("i-restart", "checkpoint_restart", at(400), 105_000.0, 37, 2)
DRAIN = IncidentFacts("i-drain", "migrated_proactive", at(700), 500.0, 0, 3)


def test_a_jobs_lost_time_is_stall_plus_lost_steps_and_progress_is_the_rest() -> None:
    g = job_goodput(JOB, [DRAIN, LIVE, RESTARTED], RESTART)
    adds_up(g)
    assert g.gpu_seconds_allocated == 4000.0
    by_id = {i.incident_id: i for i in g.incidents}
    # stall 2 s x 4 ranks + 1 lost step x 0.5 s x 4 ranks
    assert (by_id["i-live"].stall_gpu_seconds, by_id["i-live"].lost_steps_gpu_seconds) == (8, 2)
    # the restart: 105 s from the fault to the first step, 37 steps done again
    assert by_id["i-restart"].stall_gpu_seconds == 420.0
    assert by_id["i-restart"].lost_steps_gpu_seconds == 74.0
    assert by_id["i-drain"].gpu_seconds_lost == 2.0
    assert g.gpu_seconds_lost == 506.0
    assert g.gpu_seconds_progress == 3494.0
    assert g.ettr == pytest.approx(0.8735)
    assert [i.incident_id for i in g.incidents] == ["i-live", "i-restart", "i-drain"]


def test_the_counterfactual_prices_a_restart_for_each_failure_resolved_otherwise() -> None:
    g = job_goodput(JOB, [LIVE, RESTARTED, DRAIN], RESTART)
    by_id = {i.incident_id: i for i in g.incidents}
    # a live migration under checkpoint restart: the restart plus half an interval of steps
    assert by_id["i-live"].counterfactual_gpu_seconds == 4 * (60 + 50 * 0.5)
    # the restart costs what it cost; a drain only the restart (checkpoint at the boundary)
    assert by_id["i-restart"].counterfactual_gpu_seconds == 494.0
    assert by_id["i-drain"].counterfactual_gpu_seconds == 240.0
    figures = g.summary(RESTART)["counterfactual"]
    assert figures["gpu_seconds_lost"] == 340 + 494 + 240
    assert figures["gpu_seconds_saved"] == 1074 - 506
    assert figures["gpu_hours_saved"] == pytest.approx(568 / 3600, abs=1e-6)
    assert figures["money_saved_minor"] == 39  # 568 s at 250 an hour = 39.44
    assert (
        job_goodput(JOB, [LIVE], Assumptions(100, 60.0)).summary(Assumptions(100, 60.0))[
            "counterfactual"
        ]["money_saved_minor"]
        is None
    )


def test_a_stall_two_incidents_share_counts_once_on_the_first() -> None:
    # A node fault hurts ranks 0 and 1: two incidents, one stall of the whole job.
    a = IncidentFacts("i-a", "migrated_live", at(200), 3000.0, 1, 1)
    b = IncidentFacts("i-b", "migrated_live", at(200.5), 3000.0, 1, 1)
    g = job_goodput(JOB, [b, a], RESTART)
    adds_up(g)
    by_id = {i.incident_id: i for i in g.incidents}
    assert by_id["i-a"].stall_gpu_seconds == 12.0
    assert by_id["i-b"].stall_gpu_seconds == 2.0  # only the 0.5 s after a's stall ended
    assert g.gpu_seconds_lost == 12 + 2 + 2 * 2


def test_a_window_cuts_the_allocation_and_the_stall_and_keeps_incidents_detected_in_it() -> None:
    g = job_goodput(JOB, [LIVE, RESTARTED, DRAIN], RESTART, since=at(300), until=at(450))
    adds_up(g)
    assert g.gpu_seconds_allocated == 4 * 150
    assert [i.incident_id for i in g.incidents] == ["i-restart"]
    # the stall runs past the window's end at 450 s: 50 s of it fall inside
    assert g.incidents[0].stall_gpu_seconds == 200.0
    assert g.gpu_seconds_progress == 600 - 200 - 74


def test_a_shrunk_job_is_allocated_the_ranks_it_kept() -> None:
    job = JobFacts(
        "j2",
        "acme",
        (GenerationSpan(1, at(0), 4), GenerationSpan(2, at(100), 3)),
        end=at(200),
        step_time_s=1.0,
    )
    shrunk = IncidentFacts("i-s", "shrunk", at(90), 10_000.0, 2, 1)
    g = job_goodput(job, [shrunk], RESTART)
    adds_up(g)
    assert g.gpu_seconds_allocated == 4 * 100 + 3 * 100
    assert g.incidents[0].world_size == 4
    assert g.incidents[0].gpu_seconds_lost == 4 * 10 + 4 * 2 * 1.0


def test_tenant_sums_add_up_and_an_unformed_job_has_nothing() -> None:
    total = Goodput()
    total.add(job_goodput(JOB, [LIVE, RESTARTED], RESTART))
    total.add(job_goodput(JOB, [DRAIN], RESTART))
    adds_up(total)
    assert total.gpu_seconds_allocated == 8000.0
    assert total.gpu_seconds_lost == 506.0
    empty = job_goodput(JobFacts("j3", "acme", (), end=at(10)), [LIVE], RESTART)
    assert (empty.gpu_seconds_allocated, empty.ettr, empty.incidents) == (0.0, None, [])


def test_incident_facts_read_an_incidents_json() -> None:
    facts = IncidentFacts.of(
        {
            "incident_id": "i-9",
            "resolution": "checkpoint_restart",
            "detected_at": "2026-01-05T12:00:00Z",
            "stall_ms": 1500.0,
            "lost_steps": 3,
            "generation_before": 2,
        }
    )
    assert facts == IncidentFacts("i-9", "checkpoint_restart", T0, 1500.0, 3, 2)


@pytest.mark.parametrize(
    ("seconds", "price", "minor"), [(1800, 3, 2), (1799.999, 3, 1), (-1800, 3, -2), (0, 9, 0)]
)
def test_money_rounds_half_away_from_zero_exactly(seconds: float, price: int, minor: int) -> None:
    assert money_minor(seconds, price) == minor


@pytest.mark.parametrize(
    ("asked", "currency", "contract", "contract_currency", "price"),
    [
        (300, "USD", 200, "EUR", (300, "USD")),  # the query wins
        (None, None, 200, "EUR", (200, "EUR")),  # else the contract's, in its currency
        (None, "EUR", 200, "EUR", (200, "EUR")),
        (None, "USD", 200, "EUR", (None, "USD")),  # another currency: the operator default
        (None, None, None, "EUR", (None, None)),  # a contract without a price
    ],
)
def test_the_price_is_the_asked_one_else_the_contracts_in_its_currency(
    asked: int | None,
    currency: str | None,
    contract: int | None,
    contract_currency: str,
    price: tuple[int | None, str | None],
) -> None:
    assert price_for(asked, currency, contract, contract_currency) == price


def test_a_term_is_clipped_to_the_window_and_one_outside_it_is_none() -> None:
    assert term_window(at(0), at(100), None, None) == (at(0), at(100))
    assert term_window(at(0), at(100), at(30), at(60)) == (at(30), at(60))
    assert term_window(at(0), at(100), at(-50), at(200)) == (at(0), at(100))
    assert term_window(at(0), at(100), at(100), None) is None
    assert term_window(at(0), at(100), None, at(0)) is None
