"""The migration saga's state machine, without servers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.migration_executor import saga
from services.migration_executor.saga import (
    JobTerms,
    Lease,
    Phase,
    ResumeStats,
    SagaState,
    Timing,
)
from torchrelay.contract import (
    FaultKind,
    Generation,
    JobPolicy,
    MigrationMode,
    MigrationRequested,
    RankAssignment,
    Resolution,
    SpareSlot,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TIMING = Timing(
    join_timeout_s=10, resume_timeout_s=5, reserve_timeout_s=3, retry_s=1, max_attempts=2
)


def request(
    kind: FaultKind = FaultKind.WORKER_LOST, mode: MigrationMode = MigrationMode.IMMEDIATE
) -> MigrationRequested:
    return MigrationRequested(
        event_id="r",
        source="scheduler",
        migration_id="m1",
        incident_id="i1",
        job_id="j",
        tenant="acme",
        rank=1,
        member_id="j-w1",
        node="local-1",
        gpu=0,
        mode=mode,
        fault_kind=kind,
        generation_before=1,
    )


def new(
    policy: JobPolicy = JobPolicy.WAIT,
    allow_shrink: bool = False,
    kind: FaultKind = FaultKind.WORKER_LOST,
) -> SagaState:
    terms = JobTerms(world_size=4, policy=policy, wait_timeout_s=30, allow_shrink=allow_shrink)
    return saga.start(request(kind), terms, T0)


def lease(member: str | None = "j-s0", lease_id: str = "L1") -> Lease:
    return Lease(
        lease_id=lease_id,
        slot=SpareSlot(
            slot_id="local:local-2:0",
            node="local-2",
            gpu=0,
            member_id=member,
            job_id="j" if member else None,
        ),
    )


def gen(n: int, members: list[str], migration_id: str | None = None) -> Generation:
    return Generation(
        job_id="j",
        generation=n,
        world_size=len(members),
        ranks=[
            RankAssignment(rank=i, member_id=m, node=f"local-{i}", gpu=0)
            for i, m in enumerate(members)
        ],
        store_member=members[0],
        store_addr="127.0.0.1:1",
        migration_id=migration_id,
    )


def test_start_reserves_and_names_the_failed_member() -> None:
    s = new()
    assert s.phase == Phase.RESERVE
    assert s.holder_member == "j-w1"
    assert s.attempt == 1


def test_hot_spare_goes_straight_to_publish() -> None:
    s = saga.reserved(new(), lease(), T0, TIMING)
    assert s.phase == Phase.PUBLISH
    assert s.spare_member == "j-s0"
    assert s.lease is not None


def test_cold_slot_is_spawned_then_awaits_join_with_deadline() -> None:
    s = saga.reserved(new(), lease(member=None), T0, TIMING)
    assert s.phase == Phase.SPAWN
    s = saga.spawned(s, "j-s3", T0, TIMING)
    assert s.phase == Phase.AWAIT_JOIN
    assert s.spare_member == "j-s3"
    assert s.deadline == T0 + timedelta(seconds=10)
    assert saga.joined(s, T0).phase == Phase.PUBLISH


def test_happy_path_to_done() -> None:
    s = saga.reserved(new(), lease(), T0, TIMING)
    g2 = gen(2, ["j-w0", "j-s0", "j-w2", "j-w3"], "m1")
    s = saga.published(s, g2, T0, TIMING)
    assert s.phase == Phase.AWAIT_RESUME
    assert (s.generation_before, s.generation_after) == (1, 2)
    assert s.deadline == T0 + timedelta(seconds=5)
    s = saga.resumed(s, ResumeStats(stall_ms=40, lost_steps=1, bytes_moved=10), T0)
    assert s.phase == Phase.CONFIRM
    s = saga.confirmed(s, T0)
    assert s.phase == Phase.QUARANTINE
    s = saga.quarantined(s, T0)
    assert s.phase == Phase.FENCE
    s = saga.fenced(s, T0)
    assert s.phase == Phase.COMPLETE
    s = saga.done(s, T0)
    assert s.phase == Phase.DONE
    assert s.outcome == "completed"
    assert s.to_release == []  # the confirmed lease is kept, never released
    assert [h["phase"] for h in s.history] == [
        "reserve",
        "publish",
        "await_resume",
        "confirm",
        "quarantine",
        "fence",
        "complete",
        "done",
    ]


def test_wait_policy_waits_then_falls_back_to_checkpoint_restart() -> None:
    s = saga.no_spare(new(JobPolicy.WAIT), T0, TIMING, "empty pool")
    assert s.phase == Phase.WAIT_SPARE
    assert s.wait_until == T0 + timedelta(seconds=30)
    assert saga.waiting_for(s, T0 + timedelta(seconds=0.5))
    assert not saga.waiting_for(s, T0 + timedelta(seconds=1))
    # Still none 10 s later: keep waiting, the bound does not move.
    s = saga.still_waiting(s, T0 + timedelta(seconds=10), TIMING)
    assert s.phase == Phase.WAIT_SPARE
    assert s.wait_until == T0 + timedelta(seconds=30)
    s = saga.still_waiting(s, T0 + timedelta(seconds=31), TIMING)
    assert s.phase == Phase.FAIL
    assert s.fallback == Resolution.CHECKPOINT_RESTART


def test_a_wait_past_its_timeout_shrinks_where_the_user_allowed_it() -> None:
    s = saga.no_spare(new(JobPolicy.WAIT, allow_shrink=True), T0, TIMING, "empty pool")
    assert s.phase == Phase.WAIT_SPARE
    s = saga.still_waiting(s, T0 + timedelta(seconds=31), TIMING)
    assert s.phase == Phase.SHRINK
    assert "no spare within 30s" in s.history[-1]["note"]


def test_spare_found_during_wait_is_used() -> None:
    s = saga.no_spare(new(JobPolicy.WAIT), T0, TIMING, "empty pool")
    s = saga.reserved(s, lease(), T0 + timedelta(seconds=5), TIMING)
    assert s.phase == Phase.PUBLISH
    assert s.mode == MigrationMode.IMMEDIATE  # still a live migration


@pytest.mark.parametrize(
    ("policy", "allow", "phase", "fallback"),
    [
        (JobPolicy.SHRINK, True, Phase.SHRINK, None),
        (JobPolicy.SHRINK, False, Phase.FAIL, Resolution.CHECKPOINT_RESTART),
        (JobPolicy.CHECKPOINT_RESTART, True, Phase.FAIL, Resolution.CHECKPOINT_RESTART),
    ],
)
def test_policy_without_spare(
    policy: JobPolicy, allow: bool, phase: Phase, fallback: Resolution | None
) -> None:
    s = saga.no_spare(new(policy, allow_shrink=allow), T0, TIMING, "empty pool")
    assert s.phase == phase
    assert s.fallback == fallback


def test_shrink_reports_shrunk_after_quarantine_and_fence() -> None:
    s = saga.no_spare(new(JobPolicy.SHRINK, allow_shrink=True), T0, TIMING, "empty")
    s = saga.shrunk(s, gen(2, ["j-w0", "j-w2", "j-w3"], "m1"), T0)
    assert s.phase == Phase.QUARANTINE
    s = saga.fenced(saga.quarantined(s, T0), T0)
    assert s.phase == Phase.FAIL
    assert s.fallback == Resolution.SHRUNK


def test_fail_releases_the_lease() -> None:
    s = saga.reserved(new(), lease(), T0, TIMING)
    s = saga.fail(s, Resolution.LOST, T0, "rank moved")
    assert s.lease is None
    assert s.to_release == ["L1"]


def test_resume_timeout_compensates_and_retries_from_the_spare() -> None:
    s = saga.reserved(new(), lease(), T0, TIMING)
    s = saga.published(s, gen(2, ["j-w0", "j-s0", "j-w2", "j-w3"], "m1"), T0, TIMING)
    s = saga.timed_out(s, T0 + timedelta(seconds=6), TIMING, "no RESUMED from j-s0")
    assert s.phase == Phase.RESERVE
    assert s.attempt == 2
    assert s.lease is None
    assert s.to_release == ["L1"]
    assert s.to_fence == ["j-s0"]
    assert [q.node for q in s.to_quarantine] == ["local-2"]
    # The rank now belongs to the spare that never came up: that is what to replace.
    assert s.holder_member == "j-s0"
    assert s.generation_before == 2
    assert s.generation_after is None


def test_attempts_exhausted_apply_the_policy_at_once() -> None:
    s = saga.reserved(new(JobPolicy.WAIT), lease(), T0, TIMING)
    s = saga.timed_out(s, T0, TIMING, "x")  # attempt 2
    s = saga.reserved(s, lease(lease_id="L2"), T0, TIMING)
    s = saga.timed_out(s, T0, TIMING, "y")  # attempt 3 > max 2
    assert s.phase == Phase.FAIL
    assert s.fallback == Resolution.CHECKPOINT_RESTART
    assert s.to_release == ["L1", "L2"]


def test_pool_unreachable_retries_until_reserve_deadline() -> None:
    s = new(JobPolicy.CHECKPOINT_RESTART)
    s1 = saga.pool_unreachable(s, T0 + timedelta(seconds=1), TIMING)
    assert s1.phase == Phase.RESERVE
    assert s1.next_try_at == T0 + timedelta(seconds=2)
    s2 = saga.pool_unreachable(s, T0 + timedelta(seconds=3), TIMING)
    assert s2.phase == Phase.FAIL


def test_abort_only_before_the_new_generation_is_committed() -> None:
    s = saga.reserved(new(), lease(), T0, TIMING)
    a = saga.aborted(s, T0, "the job finished")
    assert a.phase == Phase.FAIL
    assert a.fallback == Resolution.LOST
    assert a.to_release == ["L1"]
    c = saga.confirmed(saga.resumed(s, ResumeStats(), T0), T0)
    assert saga.aborted(c, T0, "the job finished") is c


def test_a_warning_whose_job_ended_before_the_move_is_excluded_not_lost() -> None:
    s = saga.reserved(new(), lease(), T0, TIMING)
    warned = s.model_copy(update={"mode": MigrationMode.BOUNDARY})
    a = saga.aborted(warned, T0, "the job finished")
    assert a.phase == Phase.FAIL
    assert a.fallback == Resolution.EXCLUDED  # not an eligible, unresolved failure
    assert a.to_release == ["L1"]


@pytest.mark.parametrize(
    ("kind", "quarantine"),
    [
        (FaultKind.GPU_LOST, True),
        (FaultKind.UNCORRECTABLE_MEMORY, True),
        (FaultKind.MEMORY_UNREPAIRABLE, True),
        (FaultKind.WORKER_LOST, False),  # a killed process says nothing about its GPU
        (FaultKind.WORKER_HANG, False),
        (FaultKind.ROW_REMAP_PENDING, False),  # cleared by a reset; repeats are the detector's
        (FaultKind.PLANNED_DRAIN, False),
    ],
)
def test_only_a_bad_gpu_is_quarantined(kind: FaultKind, quarantine: bool) -> None:
    assert saga.should_quarantine(kind) is quarantine


def test_state_survives_persistence() -> None:
    s = saga.published(
        saga.reserved(new(), lease(), T0, TIMING),
        gen(2, ["j-w0", "j-s0", "j-w2", "j-w3"], "m1"),
        T0,
        TIMING,
    )
    assert SagaState.model_validate_json(s.model_dump_json()) == s


def test_resume_stats_use_survivors_for_stall_and_everyone_for_bytes() -> None:
    members = ["j-w0", "j-s0", "j-w2"]
    reports = {
        "j-w0": {"stall_ms": 40.0, "lost_steps": 1, "bytes_received": 0},
        "j-s0": {"stall_ms": 9000.0, "lost_steps": 0, "bytes_received": 500},
        "j-w2": {"stall_ms": 55.0, "lost_steps": 0, "bytes_received": 20},
    }
    stats = saga.resume_stats(members, "j-s0", reports)
    assert stats == ResumeStats(stall_ms=55.0, lost_steps=1, bytes_moved=520)
    del reports["j-w2"]
    assert saga.resume_stats(members, "j-s0", reports) is None


def test_resume_stats_world_of_one_uses_the_newcomer() -> None:
    stats = saga.resume_stats(["j-s0"], "j-s0", {"j-s0": {"stall_ms": 12.0}})
    assert stats == ResumeStats(stall_ms=12.0, lost_steps=0, bytes_moved=0)


def test_shrink_generation_renumbers_ranks_and_moves_the_store() -> None:
    g = gen(3, ["j-w0", "j-w1", "j-w2"])
    s = saga.shrink_generation(g, 0, {"j-w1": "127.0.0.1:9"}, "m1", "shrink")
    assert [(a.rank, a.member_id) for a in s.ranks] == [(0, "j-w1"), (1, "j-w2")]
    assert (s.generation, s.world_size, s.store_member, s.store_addr) == (
        4,
        2,
        "j-w1",
        "127.0.0.1:9",
    )
    assert s.departing == ["j-w0"]
    with pytest.raises(ValueError, match="one rank"):
        saga.shrink_generation(gen(1, ["j-w0"]), 0, {}, "m", "x")


# A random walk over the saga's transitions: a lease the saga took is always either held
# or queued for release, never dropped, and DONE is reached only through an outcome.
_STEPS = st.lists(
    st.sampled_from(
        [
            "reserve_hot",
            "reserve_cold",
            "no_spare",
            "spawned",
            "joined",
            "published",
            "resumed",
            "timeout",
            "abort",
            "advance",
        ]
    ),
    max_size=25,
)


@settings(max_examples=100, deadline=None)
@given(_STEPS, st.sampled_from(JobPolicy), st.booleans())
def test_leases_are_never_leaked(steps: list[str], policy: JobPolicy, shrink: bool) -> None:
    s = new(policy, allow_shrink=shrink)
    now = T0
    taken: set[str] = set()
    for i, step in enumerate(steps):
        now += timedelta(seconds=7)
        p = s.phase
        if step in ("reserve_hot", "reserve_cold") and p in (Phase.RESERVE, Phase.WAIT_SPARE):
            lid = f"L{i}"
            taken.add(lid)
            s = saga.reserved(
                s, lease(None if step == "reserve_cold" else "j-s0", lid), now, TIMING
            )
        elif step == "no_spare" and p in (Phase.RESERVE, Phase.WAIT_SPARE):
            s = saga.no_spare(s, now, TIMING, "none")
        elif step == "spawned" and p == Phase.SPAWN:
            s = saga.spawned(s, f"j-s{i}", now, TIMING)
        elif step == "joined" and p == Phase.AWAIT_JOIN:
            s = saga.joined(s, now)
        elif step == "published" and p == Phase.PUBLISH:
            members = ["j-w0", s.spare_member or "x", "j-w2", "j-w3"]
            s = saga.published(s, gen(s.generation_before + 1, members, "m1"), now, TIMING)
        elif step == "resumed" and p == Phase.AWAIT_RESUME:
            s = saga.resumed(s, ResumeStats(), now)
        elif step == "timeout" and p in (Phase.SPAWN, Phase.AWAIT_JOIN, Phase.AWAIT_RESUME):
            s = saga.timed_out(s, now, TIMING, "deadline")
        elif step == "abort":
            s = saga.aborted(s, now, "job finished")
        elif step == "advance":
            if p == Phase.CONFIRM:
                s = saga.confirmed(s, now)
            elif p == Phase.QUARANTINE:
                s = saga.quarantined(s, now)
            elif p == Phase.FENCE:
                s = saga.fenced(s, now)
            elif p in (Phase.COMPLETE, Phase.FAIL):
                s = saga.done(s, now)
            elif p == Phase.SHRINK:
                s = saga.shrunk(s, gen(s.generation_before + 1, ["j-w0", "j-w2"], "m1"), now)
        held = {s.lease.lease_id} if s.lease else set()
        confirmed_done = s.outcome == "completed" and s.phase not in (
            Phase.RESERVE,
            Phase.WAIT_SPARE,
            Phase.SPAWN,
            Phase.AWAIT_JOIN,
            Phase.PUBLISH,
            Phase.AWAIT_RESUME,
        )
        assert taken <= held | set(s.to_release) | (held if confirmed_done else set())
        if s.phase == Phase.DONE:
            assert s.outcome in ("completed", "failed")
            if s.outcome == "failed":
                assert s.fallback is not None


def test_partial_resume_stats_need_the_newcomer() -> None:
    members = ["j-w0", "j-s0", "j-w2"]
    reports = {"j-w0": {"stall_ms": 30.0}, "j-s0": {"bytes_received": 7}}
    assert saga.resume_stats(members, "j-s0", reports) is None
    partial = saga.resume_stats(members, "j-s0", reports, partial=True)
    assert partial == ResumeStats(stall_ms=30.0, lost_steps=0, bytes_moved=7)
    del reports["j-s0"]
    assert saga.resume_stats(members, "j-s0", reports, partial=True) is None


def test_superseded_spare_follows_the_rank_to_the_newer_generation() -> None:
    s = saga.reserved(new(), lease(), T0, TIMING)
    s = saga.published(s, gen(2, ["j-w0", "j-s0", "j-w2", "j-w3"], "m1"), T0, TIMING)
    g3 = gen(3, ["j-w0", "j-s1", "j-w2", "j-w3"], "m2")
    s = saga.superseded(s, g3, g3.ranks[1], T0, TIMING)
    assert s.phase == Phase.AWAIT_RESUME
    assert s.to_release == ["L1"]  # the dead spare's lease goes back
    assert s.lease is None
    assert (s.spare_member, s.generation_after) == ("j-s1", 3)
    assert saga.destination(s) == ("local-1", 0)
    assert saga.members_to_fence(s) == ["j-w1"]  # the later migration fences j-s0
    # Completes without a lease of its own to confirm.
    done = saga.done(
        saga.fenced(
            saga.quarantined(
                saga.confirmed(saga.resumed(s, ResumeStats(stall_ms=1.0), T0), T0), T0
            ),
            T0,
        ),
        T0,
    )
    assert (done.phase, done.outcome) == (Phase.DONE, "completed")
    # If that generation never resumes, this saga does not touch the other one's spare.
    failed = saga.timed_out(s, T0, TIMING, "no RESUMED")
    assert (failed.phase, failed.fallback, failed.to_fence) == (Phase.FAIL, Resolution.LOST, [])


def test_escalation_before_and_after_the_boundary_generation() -> None:
    boundary = saga.start(
        request(FaultKind.ROW_REMAP_PENDING, MigrationMode.BOUNDARY), JobTerms(), T0
    )
    early = saga.escalate(boundary, T0)
    assert (early.phase, early.mode) == (Phase.RESERVE, MigrationMode.IMMEDIATE)
    s = saga.reserved(boundary, lease(), T0, TIMING)
    s = saga.published(s, gen(2, ["j-w0", "j-s0", "j-w2", "j-w3"], "m1"), T0, TIMING)
    late = saga.escalate(s, T0)
    assert (late.phase, late.mode) == (Phase.ESCALATE, MigrationMode.IMMEDIATE)
    again = saga.republished(late, gen(3, ["j-w0", "j-s0", "j-w2", "j-w3"], "m1"), T0, TIMING)
    assert (again.phase, again.generation_after) == (Phase.AWAIT_RESUME, 3)
    # Nothing to do for an immediate migration, or once the ranks resumed.
    assert saga.escalate(new(), T0) is not None
    assert saga.escalate(new(), T0).mode == MigrationMode.IMMEDIATE
    done = saga.resumed(s, ResumeStats(), T0)
    assert saga.escalate(done, T0) is done
