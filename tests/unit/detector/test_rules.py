"""The detector's rules without any server: taxonomy, windows, episodes, breaker, jobs."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.detector.rules import (
    TAXONOMY,
    CounterWindow,
    DetectorConfig,
    Episode,
    GpuWindows,
    MemberProgress,
    StragglerTracker,
    breaker_allows,
    decide,
    episode_step,
    evaluate_sample,
    hang_bound,
    hung_members,
    lemon_update,
    lost_members,
    straggler_ranks,
)
from torchrelay.contract import FaultAction, FaultKind, NodeHealth, Severity, TelemetrySample

CFG = DetectorConfig()
T0 = 1_800_000_000.0


def sample(ts: float = T0, **fields: Any) -> TelemetrySample:
    return TelemetrySample(
        cluster="c", node="n0", gpu=0, ts=datetime.fromtimestamp(ts, UTC), **fields
    )


def kinds(findings: list[Any]) -> set[FaultKind]:
    return {f.kind for f in findings}


# --------------------------------------------------------------------------- taxonomy rows

# (signal fields of one sample) -> the kind docs/design.md §5 assigns it.
INSTANT_ROWS: list[tuple[dict[str, Any], FaultKind]] = [
    ({"xid": 79}, FaultKind.GPU_LOST),
    ({"gpu_lost": True}, FaultKind.GPU_LOST),
    ({"reset_required": True}, FaultKind.GPU_LOST),
    ({"xid": 48}, FaultKind.UNCORRECTABLE_MEMORY),
    ({"xid": 95}, FaultKind.UNCORRECTABLE_MEMORY),
    ({"xid": 140}, FaultKind.UNCORRECTABLE_MEMORY),
    ({"ecc_volatile_uncorrected": 1}, FaultKind.UNCORRECTABLE_MEMORY),
    ({"xid": 62}, FaultKind.FIRMWARE_HANG),
    ({"xid": 119}, FaultKind.FIRMWARE_HANG),
    ({"xid": 120}, FaultKind.FIRMWARE_HANG),
    ({"xid": 143}, FaultKind.FIRMWARE_HANG),
    ({"recovery_action": 1}, FaultKind.FIRMWARE_HANG),  # GPU reset
    ({"recovery_action": 2}, FaultKind.FIRMWARE_HANG),  # node reboot
    ({"remap_failure": True}, FaultKind.MEMORY_UNREPAIRABLE),
    ({"unrepairable_memory": True}, FaultKind.MEMORY_UNREPAIRABLE),
    ({"xid": 64}, FaultKind.MEMORY_UNREPAIRABLE),
    ({"remap_pending": True}, FaultKind.ROW_REMAP_PENDING),
    ({"xid": 63}, FaultKind.ROW_REMAP_PENDING),
    ({"xid": 74}, FaultKind.NVLINK_FATAL),
    *[({"xid": x}, FaultKind.NVLINK_FATAL) for x in range(144, 151)],
    ({"nvlink_down_links": 1}, FaultKind.NVLINK_FATAL),
    ({"xid": 13}, FaultKind.APPLICATION_ERROR),
    ({"xid": 31}, FaultKind.APPLICATION_ERROR),
    ({"xid": 43}, FaultKind.APPLICATION_ERROR),
    ({"xid": 45}, FaultKind.APPLICATION_ERROR),
]


@pytest.mark.parametrize(
    ("fields", "kind"),
    INSTANT_ROWS,
    ids=[f"{k.value}-{next(iter(f))}={next(iter(f.values()))}" for f, k in INSTANT_ROWS],
)
def test_each_signal_maps_to_its_taxonomy_kind(fields: dict[str, Any], kind: FaultKind) -> None:
    found = evaluate_sample(GpuWindows(CFG), sample(**fields), CFG)
    assert kinds(found) == {kind}


def test_a_healthy_sample_raises_nothing() -> None:
    healthy = sample(
        temperature_c=60,
        temp_slowdown_c=87,
        ecc_volatile_uncorrected=0,
        ecc_volatile_corrected=3,
        remap_pending=False,
        pcie_replay_count=2,
        nvlink_crc_errors=5,
        nvlink_replay_errors=0,
        nvlink_recovery_errors=0,
        hw_slowdown=False,
        recovery_action=0,
        xid=None,
    )
    assert evaluate_sample(GpuWindows(CFG), healthy, CFG) == []


def test_unknown_xid_is_not_a_fault() -> None:
    assert evaluate_sample(GpuWindows(CFG), sample(xid=999), CFG) == []


# Severity and action of every row (docs/design.md §5 "action" column).
EXPECTED = {
    FaultKind.GPU_LOST: (Severity.FATAL, FaultAction.MIGRATE_NOW, NodeHealth.QUARANTINED),
    FaultKind.UNCORRECTABLE_MEMORY: (
        Severity.FATAL,
        FaultAction.MIGRATE_NOW,
        NodeHealth.QUARANTINED,
    ),
    FaultKind.FIRMWARE_HANG: (Severity.FATAL, FaultAction.MIGRATE_NOW, NodeHealth.UNHEALTHY),
    FaultKind.MEMORY_UNREPAIRABLE: (
        Severity.WARNING,
        FaultAction.QUARANTINE,
        NodeHealth.QUARANTINED,
    ),
    FaultKind.ROW_REMAP_PENDING: (
        Severity.WARNING,
        FaultAction.MIGRATE_AT_BOUNDARY,
        NodeHealth.UNHEALTHY,
    ),
    FaultKind.NVLINK_FATAL: (Severity.FATAL, FaultAction.MIGRATE_NOW, NodeHealth.UNHEALTHY),
    FaultKind.LINK_DEGRADED: (
        Severity.WARNING,
        FaultAction.MIGRATE_AT_BOUNDARY,
        NodeHealth.DEGRADED,
    ),
    FaultKind.THERMAL_SLOWDOWN: (
        Severity.WARNING,
        FaultAction.MIGRATE_AT_BOUNDARY,
        NodeHealth.DEGRADED,
    ),
    FaultKind.STRAGGLER: (Severity.WARNING, FaultAction.MIGRATE_AT_BOUNDARY, None),
    FaultKind.WORKER_LOST: (Severity.FATAL, FaultAction.MIGRATE_NOW, None),
    FaultKind.WORKER_HANG: (Severity.FATAL, FaultAction.MIGRATE_NOW, None),
    FaultKind.APPLICATION_ERROR: (Severity.INFO, FaultAction.RECORD, None),
}


@pytest.mark.parametrize("kind", list(EXPECTED), ids=lambda k: k.value)
def test_every_row_has_its_severity_action_and_node_effect(kind: FaultKind) -> None:
    d = decide(kind, 1, CFG)
    assert (d.severity, d.action, d.node_health) == EXPECTED[kind]
    assert not d.escalated


def test_taxonomy_covers_every_detected_kind() -> None:
    # planned_drain comes from operators (DrainRequested), not from the detector.
    assert set(TAXONOMY) == set(FaultKind) - {FaultKind.PLANNED_DRAIN}


# --------------------------------------------------------------------------- repeat escalation


@pytest.mark.parametrize(
    "kind",
    [
        FaultKind.FIRMWARE_HANG,
        FaultKind.ROW_REMAP_PENDING,
        FaultKind.NVLINK_FATAL,
        FaultKind.THERMAL_SLOWDOWN,
        FaultKind.LINK_DEGRADED,
    ],
    ids=lambda k: k.value,
)
def test_a_hardware_fault_recurring_after_reset_goes_to_quarantine(kind: FaultKind) -> None:
    first, second = decide(kind, 1, CFG), decide(kind, 2, CFG)
    assert first.node_health != NodeHealth.QUARANTINED
    assert second.escalated
    assert second.node_health == NodeHealth.QUARANTINED
    assert second.action == first.action  # the rank still moves as the first time said


@pytest.mark.parametrize(
    "kind",
    [FaultKind.WORKER_LOST, FaultKind.STRAGGLER, FaultKind.APPLICATION_ERROR],
    ids=lambda k: k.value,
)
def test_software_faults_never_escalate(kind: FaultKind) -> None:
    assert not decide(kind, 5, CFG).escalated
    assert decide(kind, 5, CFG).node_health is None


def test_episodes_extend_while_recurring_and_count_after_quiet() -> None:
    ep = Episode()
    assert episode_step(ep, T0, 60)  # opens episode 1
    for i in range(1, 1000):
        assert not episode_step(ep, T0 + i * 0.5, 60)  # one steady condition: one episode
    assert ep.number == 1
    assert episode_step(ep, T0 + 499.5 + 61, 60)  # quiet for longer than 60 s: episode 2
    assert ep.number == 2
    ep.open = False  # the node was returned to service
    assert episode_step(ep, T0 + 600, 60)
    assert ep.number == 3


# --------------------------------------------------------------------------- rate windows


def test_counter_window_rate_ignores_how_many_samples_arrived() -> None:
    every, half = CounterWindow(60), CounterWindow(60)
    for i in range(120):
        every.add(T0 + i, i * 0.5)  # 0.5 per second = 30 per minute
        if i % 2 == 0:
            half.add(T0 + i, i * 0.5)
    assert every.rate_per_s(10) == pytest.approx(0.5, rel=0.05)
    assert half.rate_per_s(10) == pytest.approx(0.5, rel=0.05)


def test_counter_window_forgets_old_increases_and_survives_resets() -> None:
    w = CounterWindow(60)
    w.add(T0, 0)
    w.add(T0 + 1, 100)  # a burst long ago
    for i in range(2, 200):
        w.add(T0 + i, 100)
    assert w.delta() == 0
    w.add(T0 + 200, 3)  # counter reset (GPU reset) is not a negative rate
    assert w.delta() == 0
    w.add(T0 + 201, 5)
    assert w.delta() == 2


def test_a_raw_count_is_not_a_rate() -> None:
    """A large but constant PCIe replay count (history) raises nothing; a rising one does."""
    w = GpuWindows(CFG)
    for i in range(120):
        assert evaluate_sample(w, sample(T0 + i, pcie_replay_count=5000), CFG) == []
    found: set[FaultKind] = set()
    for i in range(120, 240):  # 12 replays per minute > DCGM's 8/min
        found |= kinds(evaluate_sample(w, sample(T0 + i, pcie_replay_count=5000 + i // 5), CFG))
    assert found == {FaultKind.LINK_DEGRADED}


def test_nvlink_crc_rate_over_threshold_is_link_degraded() -> None:
    w = GpuWindows(CFG)
    out: set[FaultKind] = set()
    for i in range(30):
        out |= kinds(evaluate_sample(w, sample(T0 + i, nvlink_crc_errors=i * 500), CFG))
    assert out == {FaultKind.LINK_DEGRADED}


def test_nvlink_replay_or_recovery_delta_is_fatal_but_history_is_not() -> None:
    w = GpuWindows(CFG)
    assert (
        evaluate_sample(w, sample(T0, nvlink_replay_errors=7, nvlink_recovery_errors=2), CFG) == []
    )
    found = evaluate_sample(
        w, sample(T0 + 1, nvlink_replay_errors=7, nvlink_recovery_errors=3), CFG
    )
    assert kinds(found) == {FaultKind.NVLINK_FATAL}


def test_corrected_ecc_storm_asks_for_a_row_remap() -> None:
    w = GpuWindows(CFG)
    out: set[FaultKind] = set()
    for i in range(30):
        out |= kinds(evaluate_sample(w, sample(T0 + i, ecc_volatile_corrected=i * 40), CFG))
    assert out == {FaultKind.ROW_REMAP_PENDING}


def test_thermal_slowdown_needs_a_rate_not_one_blip() -> None:
    w = GpuWindows(CFG)
    # 5 seconds of HW slowdown in ten minutes: 0.5/min, below gpud's 0.6/min.
    for i in range(600):
        slow = i % 120 == 0
        found = evaluate_sample(
            w, sample(T0 + i, hw_slowdown=slow, temperature_c=70, temp_slowdown_c=87), CFG
        )
        assert FaultKind.THERMAL_SLOWDOWN not in kinds(found)
    # A steady slowdown crosses 0.6/min after six distinct seconds.
    fired_at = None
    for i in range(600, 700):
        found = evaluate_sample(
            w, sample(T0 + i, hw_thermal_slowdown=True, temperature_c=87, temp_slowdown_c=87), CFG
        )
        if kinds(found) == {FaultKind.THERMAL_SLOWDOWN}:
            fired_at = i
            assert found[0].evidence["margin_c"] == 0
            break
    assert fired_at is not None
    assert fired_at - 600 <= 6


def test_low_thermal_margin_counts_as_slowdown() -> None:
    w = GpuWindows(CFG)
    found: set[FaultKind] = set()
    for i in range(10):
        found |= kinds(
            evaluate_sample(w, sample(T0 + i, temperature_c=86, temp_slowdown_c=87), CFG)
        )
    assert found == {FaultKind.THERMAL_SLOWDOWN}


# --------------------------------------------------------------------------- nodes


def test_circuit_breaker_caps_the_share_of_a_cluster_out_of_service() -> None:
    cfg = DetectorConfig(breaker_max_share=0.25)
    assert breaker_allows(0, 100, cfg)
    assert breaker_allows(24, 100, cfg)
    assert not breaker_allows(25, 100, cfg)  # a 26th node would be over 25%
    # A small cluster may still lose one node, not two.
    assert breaker_allows(0, 2, cfg)
    assert not breaker_allows(1, 2, cfg)


def test_lemon_score_decays_and_accumulates() -> None:
    day = 24 * 3600.0
    s = lemon_update(0.0, T0, T0, 1.0, 7 * day)
    s = lemon_update(s, T0, T0 + 7 * day, 1.0, 7 * day)  # the first has halved
    assert s == pytest.approx(1.5)


# --------------------------------------------------------------------------- heartbeats


def member(
    mid: str, rank: int, last_seen: float, last_progress: float, step: int = 10
) -> MemberProgress:
    return MemberProgress(mid, rank, "n0", rank, "c", 1, step, last_seen, last_progress)


def test_heartbeats_gone_past_the_timeout_is_lost() -> None:
    timeout = CFG.heartbeat_timeout_s
    members = {
        "a": member("a", 0, T0 - 0.9 * timeout, T0),
        "b": member("b", 1, T0 - 1.1 * timeout, T0 - 1.1 * timeout),
    }
    assert [m.member_id for m in lost_members(members, T0, CFG)] == ["b"]


def test_hang_bound_is_learned_from_the_jobs_own_step_times() -> None:
    assert hang_bound([0.1] * 4, CFG) is None  # not enough steps to know
    assert hang_bound([0.1] * 50, CFG) == CFG.hang_floor_s  # fast steps: the floor
    slow = [2.0] * 50
    assert hang_bound(slow, CFG) == pytest.approx(20.0)  # 10 x p95
    # One outlier step does not move the p95.
    assert hang_bound([1.0] * 99 + [100.0], CFG) == pytest.approx(10.0)


def test_alive_member_without_progress_past_the_bound_is_hung() -> None:
    bound = 10.0
    members = {"a": member("a", 0, T0, T0 - 1, step=11), "b": member("b", 1, T0, T0 - 11, step=10)}
    hang = hung_members(members, bound, T0, CFG)
    assert hang is not None
    assert not hang.job_wide
    assert [m.member_id for m in hang.stalled] == ["b"]
    assert hung_members(members, None, T0, CFG) is None  # no bound yet: no verdict


def test_everyone_stalled_at_one_step_is_a_job_wide_hang() -> None:
    members = {m: member(m, i, T0, T0 - 30, step=10) for i, m in enumerate("abcd")}
    hang = hung_members(members, 10.0, T0, CFG)
    assert hang is not None
    assert hang.job_wide
    assert len(hang.stalled) == 4
    members["c"].step = 9  # the rank that never committed step 10 is the suspect
    hang = hung_members(members, 10.0, T0, CFG)
    assert hang is not None
    assert not hang.job_wide
    assert [m.member_id for m in hang.stalled] == ["c"]


def test_a_silent_member_is_not_hung_it_is_lost() -> None:
    members = {"a": member("a", 0, T0 - 2 * CFG.heartbeat_timeout_s, T0 - 50)}
    assert hung_members(members, 10.0, T0, CFG) is None


# --------------------------------------------------------------------------- straggler


def step_times(
    ranks: int, slow: dict[int, float], noise: float, n: int, rng: random.Random
) -> dict[int, list[float]]:
    return {
        r: [0.2 * slow.get(r, 1.0) * rng.uniform(1 - noise, 1 + noise) for _ in range(n)]
        for r in range(ranks)
    }


def test_a_rank_one_and_a_half_times_slower_for_a_sustained_window_is_flagged() -> None:
    rng = random.Random(1)
    tracker = StragglerTracker()
    flagged: dict[int, dict[str, float]] = {}
    for second in range(8):
        times = step_times(8, {3: 1.5}, 0.1, 20, rng)
        flagged = tracker.update(straggler_ranks(times, CFG), T0 + second, CFG)
        if second < CFG.straggler_sustain_s:
            assert flagged == {}  # not yet sustained
    assert list(flagged) == [3]
    assert flagged[3]["ratio"] == pytest.approx(1.5, rel=0.1)


def test_a_slow_moment_that_does_not_last_is_not_flagged() -> None:
    rng = random.Random(2)
    tracker = StragglerTracker()
    tracker.update(straggler_ranks(step_times(4, {1: 1.5}, 0.1, 20, rng), CFG), T0, CFG)
    out = tracker.update(straggler_ranks(step_times(4, {}, 0.1, 20, rng), CFG), T0 + 3, CFG)
    out = tracker.update(straggler_ranks(step_times(4, {1: 1.5}, 0.1, 20, rng), CFG), T0 + 6, CFG)
    assert out == {}


def test_two_rank_job_still_finds_its_straggler() -> None:
    rng = random.Random(3)
    assert list(straggler_ranks(step_times(2, {1: 1.5}, 0.05, 20, rng), CFG)) == [1]


@settings(max_examples=60, deadline=None)
@given(
    ranks=st.integers(min_value=2, max_value=64),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(min_value=CFG.straggler_min_samples, max_value=40),
)
def test_ten_percent_noise_on_every_rank_is_never_flagged(ranks: int, seed: int, n: int) -> None:
    rng = random.Random(seed)
    assert straggler_ranks(step_times(ranks, {}, 0.10, n, rng), CFG) == {}


@settings(max_examples=40, deadline=None)
@given(ranks=st.integers(min_value=3, max_value=64), seed=st.integers(0, 2**32 - 1))
def test_one_and_a_half_times_slower_is_always_seen_through_noise(ranks: int, seed: int) -> None:
    rng = random.Random(seed)
    slow = rng.randrange(ranks)
    assert list(straggler_ranks(step_times(ranks, {slow: 1.5}, 0.10, 20, rng), CFG)) == [slow]


def test_a_waiting_hot_spare_is_never_hung() -> None:
    spare = MemberProgress("s", None, "n0", 3, "c", 0, -1, T0, T0 - 500)
    worker = member("a", 0, T0, T0 - 500)
    hang = hung_members({"s": spare, "a": worker}, 10.0, T0, CFG)
    assert hang is not None
    assert [m.member_id for m in hang.stalled] == ["a"]
