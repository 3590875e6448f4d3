"""The detector's rules: pure functions from signals and per-GPU/per-job state to findings.

Nothing here does I/O. The service feeds samples and heartbeats in, gets :class:`Finding`s
back, and turns the first finding of each episode into one ``FaultDetected``. The taxonomy
is docs/design.md §5; thresholds live in :class:`DetectorConfig`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torchrelay.contract import FaultAction, FaultKind, NodeHealth, Severity, TelemetrySample

FollowUp = Literal["quarantine", "reset", "rma", "inspect", "fence"]


@dataclass(frozen=True)
class DetectorConfig:
    """Thresholds of the rules (defaults from DCGM's health watches and gpud)."""

    # Episodes: a finding that recurs within quiet_s of the last one is the same episode.
    episode_quiet_s: float = 60.0
    # Repeat escalation: the n-th episode of a hardware kind on one GPU (after a reset or a
    # return to service) sends the node to quarantine for hardware inspection.
    repeat_escalation_after: int = 2
    # thermal_slowdown: HW slowdown seen in >= this many distinct seconds per minute of window.
    thermal_window_s: float = 600.0
    thermal_events_per_min: float = 0.6
    thermal_margin_low_c: float = 2.0
    # link_degraded: counter rates over a window (DCGM: PCIe 8 replays/min, NVLink CRC 100/s).
    rate_window_s: float = 60.0
    rate_min_span_s: float = 10.0
    pcie_replays_per_min: float = 8.0
    nvlink_crc_per_s: float = 100.0
    # A storm of corrected ECC errors: the memory wants a row remap (migrate, reset).
    ecc_corrected_per_min: float = 1000.0
    # Heartbeats.
    heartbeat_timeout_s: float = 5.0
    launcher_timeout_s: float = 2.0  # a host launcher's silence: the host is lost
    # worker_hang: bound = max(floor, factor x p95 of the job's own step times).
    hang_floor_s: float = 10.0  # above the heartbeat timeout: a stopped rank is lost, not hung
    hang_factor: float = 10.0
    hang_min_steps: int = 5
    # straggler: a rank's median step time vs the median of the other ranks.
    straggler_ratio: float = 1.3
    straggler_mad_k: float = 3.0
    straggler_min_samples: int = 8
    straggler_window: int = 20
    straggler_sustain_s: float = 5.0
    # Lemon score: decayed sum of hardware faults per node.
    lemon_half_life_s: float = 7 * 24 * 3600.0
    lemon_threshold: float = 3.0
    # Circuit breaker: never mark more than this share of a cluster's nodes unhealthy.
    breaker_max_share: float = 0.25
    breaker_min_nodes: int = 1


# --------------------------------------------------------------------------- taxonomy


@dataclass(frozen=True)
class TaxonomyRow:
    """What a kind of fault is and what the detector recommends."""

    kind: FaultKind
    severity: Severity
    action: FaultAction
    follow_up: FollowUp | None  # what happens to the node/GPU after the rank moves
    hardware: bool  # counts toward the lemon score and repeat escalation


TAXONOMY: dict[FaultKind, TaxonomyRow] = {
    row.kind: row
    for row in (
        TaxonomyRow(
            FaultKind.GPU_LOST, Severity.FATAL, FaultAction.MIGRATE_NOW, "quarantine", True
        ),
        TaxonomyRow(
            FaultKind.UNCORRECTABLE_MEMORY,
            Severity.FATAL,
            FaultAction.MIGRATE_NOW,
            "quarantine",
            True,
        ),
        TaxonomyRow(
            FaultKind.FIRMWARE_HANG, Severity.FATAL, FaultAction.MIGRATE_NOW, "reset", True
        ),
        TaxonomyRow(
            FaultKind.MEMORY_UNREPAIRABLE, Severity.WARNING, FaultAction.QUARANTINE, "rma", True
        ),
        TaxonomyRow(
            FaultKind.ROW_REMAP_PENDING,
            Severity.WARNING,
            FaultAction.MIGRATE_AT_BOUNDARY,
            "reset",
            True,
        ),
        TaxonomyRow(FaultKind.NVLINK_FATAL, Severity.FATAL, FaultAction.MIGRATE_NOW, "reset", True),
        TaxonomyRow(
            FaultKind.LINK_DEGRADED,
            Severity.WARNING,
            FaultAction.MIGRATE_AT_BOUNDARY,
            "inspect",
            True,
        ),
        TaxonomyRow(
            FaultKind.THERMAL_SLOWDOWN,
            Severity.WARNING,
            FaultAction.MIGRATE_AT_BOUNDARY,
            "inspect",
            True,
        ),
        TaxonomyRow(
            FaultKind.STRAGGLER, Severity.WARNING, FaultAction.MIGRATE_AT_BOUNDARY, None, False
        ),
        TaxonomyRow(FaultKind.WORKER_LOST, Severity.FATAL, FaultAction.MIGRATE_NOW, None, False),
        TaxonomyRow(FaultKind.WORKER_HANG, Severity.FATAL, FaultAction.MIGRATE_NOW, "fence", False),
        TaxonomyRow(FaultKind.APPLICATION_ERROR, Severity.INFO, FaultAction.RECORD, None, False),
    )
}

# NVIDIA XID catalog → kind (docs/design.md §5).
XID_KINDS: dict[int, FaultKind] = {
    79: FaultKind.GPU_LOST,
    48: FaultKind.UNCORRECTABLE_MEMORY,
    95: FaultKind.UNCORRECTABLE_MEMORY,
    140: FaultKind.UNCORRECTABLE_MEMORY,
    62: FaultKind.FIRMWARE_HANG,
    119: FaultKind.FIRMWARE_HANG,
    120: FaultKind.FIRMWARE_HANG,
    143: FaultKind.FIRMWARE_HANG,
    64: FaultKind.MEMORY_UNREPAIRABLE,
    63: FaultKind.ROW_REMAP_PENDING,
    74: FaultKind.NVLINK_FATAL,
    **dict.fromkeys(range(144, 151), FaultKind.NVLINK_FATAL),
    13: FaultKind.APPLICATION_ERROR,
    31: FaultKind.APPLICATION_ERROR,
    43: FaultKind.APPLICATION_ERROR,
    45: FaultKind.APPLICATION_ERROR,
}

# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values (nvmlGpuRecoveryAction_t).
RECOVERY_ACTION_KINDS: dict[int, FaultKind] = {
    1: FaultKind.FIRMWARE_HANG,  # GPU_RESET
    2: FaultKind.FIRMWARE_HANG,  # NODE_REBOOT
    3: FaultKind.LINK_DEGRADED,  # DRAIN_P2P
    4: FaultKind.FIRMWARE_HANG,  # DRAIN_AND_RESET
    5: FaultKind.NVLINK_FATAL,  # RECOVER_IMEX_DOMAIN
    6: FaultKind.FIRMWARE_HANG,  # BUS_RESET
    7: FaultKind.FIRMWARE_HANG,  # SYSTEM_REBOOT
}

HEALTH_RANK: dict[NodeHealth, int] = {
    NodeHealth.HEALTHY: 0,
    NodeHealth.DEGRADED: 1,
    NodeHealth.UNHEALTHY: 2,
    NodeHealth.QUARANTINED: 3,
    NodeHealth.LEMON: 4,
}
# Health states that count against the circuit breaker (the node is out of service).
OUT_OF_SERVICE = frozenset({NodeHealth.UNHEALTHY, NodeHealth.QUARANTINED, NodeHealth.LEMON})


@dataclass(frozen=True)
class Finding:
    """A rule fired: which kind, on which signal, with what evidence."""

    kind: FaultKind
    signal: str
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """What to publish for the first finding of an episode."""

    kind: FaultKind
    severity: Severity
    action: FaultAction
    follow_up: FollowUp | None
    node_health: NodeHealth | None
    escalated: bool


def decide(kind: FaultKind, repeat: int, cfg: DetectorConfig) -> Decision:
    """Severity, action and node-health effect of the ``repeat``-th episode of ``kind``.

    Repeat escalation (after gpud): a hardware fault that recurs after its GPU was reset or
    returned to service needs hardware inspection, so the node goes to quarantine. The rank
    still moves the way the first episode said.
    """
    row = TAXONOMY[kind]
    follow_up = row.follow_up
    escalated = (
        row.hardware
        and repeat >= cfg.repeat_escalation_after
        and follow_up not in ("quarantine", "rma")
    )
    if escalated:
        follow_up = "quarantine"
    health = {
        "quarantine": NodeHealth.QUARANTINED,
        "rma": NodeHealth.QUARANTINED,
        "reset": NodeHealth.UNHEALTHY,
        "inspect": NodeHealth.DEGRADED,
    }.get(follow_up or "")
    return Decision(kind, row.severity, row.action, follow_up, health, escalated)


# --------------------------------------------------------------------------- windows


class CounterWindow:
    """A cumulative counter's change over a trailing window, from the samples one sees.

    Only changes are stored, so a steady counter costs one point. Rates are computed from
    the counter's own values, not from how many samples arrived: a replica that sees every
    other sample computes the same rate.
    """

    __slots__ = ("last_ts", "points", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        # A list, not a deque: it holds one or two points almost always, and 130k GPUs'
        # windows must fit in a replica's memory (a deque costs a 64-slot block each).
        self.points: list[tuple[float, float]] = []
        self.last_ts = 0.0

    def add(self, ts: float, value: float) -> None:
        """Record the counter's value at ``ts`` (a value below the last one is a reset)."""
        pts = self.points
        if ts > self.last_ts:
            self.last_ts = ts
        if pts:
            last = pts[-1][1]
            if value == last:  # the common case: a steady counter costs no new point
                if len(pts) > 1:
                    self._prune()
                return
            if value < last:
                pts.clear()  # the driver reset the counter (GPU reset, reload)
        pts.append((ts, value))
        self._prune()

    def _prune(self) -> None:
        pts = self.points
        horizon = self.last_ts - self.window_s
        drop = 0
        while len(pts) - drop >= 2 and pts[drop + 1][0] <= horizon:
            drop += 1
        if drop:
            del pts[:drop]

    def delta(self) -> float:
        """Increase over the window."""
        if len(self.points) < 2:
            return 0.0
        return self.points[-1][1] - self.points[0][1]

    def rate_per_s(self, min_span_s: float) -> float:
        """Increase per second over the observed part of the window (at least ``min_span_s``)."""
        if len(self.points) < 2:
            return 0.0
        span = min(self.last_ts - self.points[0][0], self.window_s)
        return self.delta() / max(span, min_span_s)


class EventSeconds:
    """Distinct seconds in a trailing window in which a condition was seen."""

    __slots__ = ("buckets", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.buckets: list[int] = []

    def add(self, ts: float) -> None:
        """The condition was seen at ``ts``."""
        b = int(ts)
        if not self.buckets or b > self.buckets[-1]:
            self.buckets.append(b)
        self.prune(ts)

    def prune(self, now: float) -> None:
        """Forget seconds older than the window."""
        horizon = now - self.window_s
        buckets = self.buckets
        if buckets and buckets[0] < horizon:
            drop = 0
            while drop < len(buckets) and buckets[drop] < horizon:
                drop += 1
            del buckets[:drop]

    def per_minute(self) -> float:
        """Seconds with the condition, per minute of window."""
        return len(self.buckets) / (self.window_s / 60.0)


class GpuWindows:
    """The rate windows of one GPU, created only once they have something to hold.

    A steady counter is two floats; its window (a :class:`CounterWindow`) appears with its
    first change, the thermal window with the first slowdown. A healthy GPU is then one
    object for the garbage collector to scan, not a dozen: with 16,000 GPUs per replica that
    is the difference between 10 ms and 100+ ms full collections.
    """

    __slots__ = ("_first", "_thermal_window", "_window", "counters", "thermal")

    def __init__(self, cfg: DetectorConfig) -> None:
        self._window = cfg.rate_window_s
        self._thermal_window = cfg.thermal_window_s
        # counter name -> (ts, value) since it took that value; replaced by a window on change
        self._first: dict[str, tuple[float, float]] | None = None
        self.counters: dict[str, CounterWindow] | None = None
        self.thermal: EventSeconds | None = None

    def counter(self, name: str, ts: float, value: float) -> CounterWindow | None:
        """Record a counter's value; its window, or None while it has never changed."""
        if self.counters is not None:
            w = self.counters.get(name)
            if w is not None:
                w.add(ts, value)
                return w
        if self._first is None:
            self._first = {}
        first = self._first.get(name)
        if first is None or value < first[1]:
            self._first[name] = (ts, value)  # first sight, or a reset: start again
            return None
        if value == first[1]:
            return None
        w = CounterWindow(self._window)
        w.points.append(first)
        w.last_ts = first[0]
        w.add(ts, value)
        del self._first[name]
        if self.counters is None:
            self.counters = {}
        self.counters[name] = w
        return w

    def thermal_seen(self, ts: float, seen: bool) -> float:
        """Record whether the thermal condition holds at ``ts``; distinct seconds per minute."""
        if seen:
            if self.thermal is None:
                self.thermal = EventSeconds(self._thermal_window)
            self.thermal.add(ts)
        elif self.thermal is not None:
            self.thermal.prune(ts)
            if not self.thermal.buckets:
                self.thermal = None
                return 0.0
        return 0.0 if self.thermal is None else self.thermal.per_minute()


# --------------------------------------------------------------------------- sample rules


def _thermal_event(s: TelemetrySample, cfg: DetectorConfig) -> bool:
    if s.hw_slowdown or s.hw_thermal_slowdown:
        return True
    if (
        s.temperature_c is not None
        and s.temp_slowdown_c is not None
        and s.temp_slowdown_c - s.temperature_c <= cfg.thermal_margin_low_c
    ):
        return True
    margin = s.extra.get("temp_margin_c")
    return margin is not None and margin <= cfg.thermal_margin_low_c


def evaluate_sample(w: GpuWindows, s: TelemetrySample, cfg: DetectorConfig) -> list[Finding]:
    """Every rule over one sample and the GPU's windows (which the sample updates).

    Returns the findings that hold *now*; the caller keeps one episode per (GPU, kind).
    """
    out: list[Finding] = []
    ts = s.ts.timestamp()
    if s.xid is not None:
        kind = XID_KINDS.get(s.xid)
        if kind is not None:
            out.append(Finding(kind, "xid", {"xid": s.xid}))
    if s.gpu_lost:
        out.append(
            Finding(
                FaultKind.GPU_LOST,
                "gpu_lost",
                {
                    "gpu_lost": True,
                    **({"gpu_count": s.extra["gpu_count"]} if "gpu_count" in s.extra else {}),
                },
            )
        )
    if s.reset_required:
        out.append(Finding(FaultKind.GPU_LOST, "reset_required", {"reset_required": True}))
    if s.ecc_volatile_uncorrected:
        out.append(
            Finding(
                FaultKind.UNCORRECTABLE_MEMORY,
                "ecc_volatile_uncorrected",
                {"ecc_volatile_uncorrected": s.ecc_volatile_uncorrected},
            )
        )
    if s.extra.get("fatal_poison"):
        out.append(Finding(FaultKind.UNCORRECTABLE_MEMORY, "fatal_poison", {}))
    if s.recovery_action:
        kind = RECOVERY_ACTION_KINDS.get(s.recovery_action)
        if kind is not None:
            out.append(Finding(kind, "recovery_action", {"recovery_action": s.recovery_action}))
    if s.remap_failure or s.unrepairable_memory:
        out.append(
            Finding(
                FaultKind.MEMORY_UNREPAIRABLE,
                "remap_failure" if s.remap_failure else "unrepairable_memory",
                {
                    "remap_failure": bool(s.remap_failure),
                    "unrepairable_memory": bool(s.unrepairable_memory),
                },
            )
        )
    if s.remap_pending:
        out.append(
            Finding(
                FaultKind.ROW_REMAP_PENDING,
                "remap_pending",
                {"remapped_rows_uncorrectable": s.remapped_rows_uncorrectable},
            )
        )
    if s.nvlink_down_links:
        out.append(
            Finding(
                FaultKind.NVLINK_FATAL, "nvlink_down", {"nvlink_down_links": s.nvlink_down_links}
            )
        )

    if s.nvlink_replay_errors is not None or s.nvlink_recovery_errors is not None:
        fatal = w.counter(
            "nvlink_fatal",
            ts,
            float((s.nvlink_replay_errors or 0) + (s.nvlink_recovery_errors or 0)),
        )
        if fatal is not None and fatal.delta() >= 1:
            out.append(
                Finding(
                    FaultKind.NVLINK_FATAL,
                    "nvlink_replay_recovery",
                    {
                        "nvlink_replay_errors": s.nvlink_replay_errors,
                        "nvlink_recovery_errors": s.nvlink_recovery_errors,
                        "delta": fatal.delta(),
                    },
                )
            )
    if s.pcie_replay_count is not None:
        pcie = w.counter("pcie", ts, float(s.pcie_replay_count))
        per_min = 0.0 if pcie is None else pcie.rate_per_s(cfg.rate_min_span_s) * 60.0
        if per_min >= cfg.pcie_replays_per_min:
            out.append(
                Finding(
                    FaultKind.LINK_DEGRADED,
                    "pcie_replay_rate",
                    {
                        "pcie_replays_per_min": round(per_min, 3),
                        "threshold_per_min": cfg.pcie_replays_per_min,
                    },
                )
            )
    if s.nvlink_crc_errors is not None:
        crc = w.counter("nvlink_crc", ts, float(s.nvlink_crc_errors))
        per_s = 0.0 if crc is None else crc.rate_per_s(cfg.rate_min_span_s)
        if per_s >= cfg.nvlink_crc_per_s:
            out.append(
                Finding(
                    FaultKind.LINK_DEGRADED,
                    "nvlink_crc_rate",
                    {"nvlink_crc_per_s": round(per_s, 3), "threshold_per_s": cfg.nvlink_crc_per_s},
                )
            )
    if s.ecc_volatile_corrected is not None:
        ecc = w.counter("ecc_corrected", ts, float(s.ecc_volatile_corrected))
        per_min = 0.0 if ecc is None else ecc.rate_per_s(cfg.rate_min_span_s) * 60.0
        if per_min >= cfg.ecc_corrected_per_min:
            out.append(
                Finding(
                    FaultKind.ROW_REMAP_PENDING,
                    "ecc_corrected_rate",
                    {
                        "ecc_corrected_per_min": round(per_min, 1),
                        "threshold_per_min": cfg.ecc_corrected_per_min,
                    },
                )
            )

    rate = w.thermal_seen(ts, _thermal_event(s, cfg))
    if rate >= cfg.thermal_events_per_min:
        margin = (
            None
            if s.temperature_c is None or s.temp_slowdown_c is None
            else round(s.temp_slowdown_c - s.temperature_c, 1)
        )
        out.append(
            Finding(
                FaultKind.THERMAL_SLOWDOWN,
                "hw_slowdown_rate",
                {
                    "slowdown_seconds_per_min": round(rate, 3),
                    "threshold_per_min": cfg.thermal_events_per_min,
                    "window_s": cfg.thermal_window_s,
                    "temperature_c": s.temperature_c,
                    "margin_c": margin,
                },
            )
        )
    return out


# --------------------------------------------------------------------------- episodes


@dataclass
class Episode:
    """The episodes of one (GPU or member, kind): how many, and the open one's times."""

    number: int = 0
    open: bool = False
    first_seen: float = 0.0
    last_seen: float = 0.0


def episode_step(ep: Episode, at: float, quiet_s: float) -> bool:
    """A finding at ``at``: extend the open episode, or open the next one (returns True).

    An episode closes by itself once its finding has not recurred for ``quiet_s``, or when
    the node is returned to service (the caller sets ``open=False``).
    """
    if ep.open and at - ep.last_seen <= quiet_s:
        ep.last_seen = max(ep.last_seen, at)
        return False
    ep.number += 1
    ep.open = True
    ep.first_seen = at
    ep.last_seen = at
    return True


# --------------------------------------------------------------------------- nodes


def lemon_update(
    score: float, last_ts: float, now: float, weight: float, half_life_s: float
) -> float:
    """A node's lemon score after one more fault of ``weight`` (older faults decay)."""
    decay = 0.5 ** (max(0.0, now - last_ts) / half_life_s) if half_life_s > 0 else 0.0
    return score * decay + weight


def lemon_weight(severity: Severity) -> float:
    """How much one hardware fault adds to its node's lemon score."""
    return {Severity.FATAL: 1.0, Severity.WARNING: 0.5}.get(severity, 0.0)


def breaker_allows(out_of_service: int, total_nodes: int, cfg: DetectorConfig) -> bool:
    """Whether one more node of a cluster may be taken out of service.

    A fleet-wide signal is more likely a bug (a driver update, a bad rule) than a fleet
    failure, so no more than ``breaker_max_share`` of the nodes go out of service at once
    (but at least ``breaker_min_nodes``, so that a small cluster can lose one).
    """
    allowed = max(cfg.breaker_min_nodes, math.floor(cfg.breaker_max_share * total_nodes))
    return out_of_service + 1 <= allowed


def worse(a: NodeHealth, b: NodeHealth) -> NodeHealth:
    """The worse of two health states."""
    return a if HEALTH_RANK[a] >= HEALTH_RANK[b] else b


# --------------------------------------------------------------------------- jobs


@dataclass
class MemberProgress:
    """What the heartbeats of one member said last."""

    member_id: str
    rank: int | None
    node: str
    gpu: int
    cluster: str
    generation: int
    step: int = -1
    last_seen: float = 0.0
    last_progress: float = 0.0


def lost_members(
    members: Mapping[str, MemberProgress], now: float, cfg: DetectorConfig
) -> list[MemberProgress]:
    """Members whose heartbeats stopped for longer than the timeout."""
    return [m for m in members.values() if now - m.last_seen > cfg.heartbeat_timeout_s]


def hang_bound(step_times: Sequence[float], cfg: DetectorConfig) -> float | None:
    """How long a member may go without a committed step, learned from the job's steps.

    None until the job has committed ``hang_min_steps`` steps (no bound without data).
    """
    if len(step_times) < cfg.hang_min_steps:
        return None
    ordered = sorted(step_times)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return max(cfg.hang_floor_s, cfg.hang_factor * p95)


@dataclass(frozen=True)
class Hang:
    """The outcome of the hang rule for one job."""

    stalled: list[MemberProgress]
    job_wide: bool  # every live member stalled together: the culprit is not known
    bound_s: float


def hung_members(
    members: Mapping[str, MemberProgress], bound: float | None, now: float, cfg: DetectorConfig
) -> Hang | None:
    """Members alive (heartbeats on time) but without step progress for longer than ``bound``.

    When every live member stalls together, the hang is the job's (a collective waiting on
    someone): the members with the lowest committed step are the suspects; if all are at the
    same step no one is singled out (``job_wide`` with every member listed).
    """
    if bound is None:
        return None
    # Only rank holders can hang: a hot spare waits without steps by design.
    alive = [
        m
        for m in members.values()
        if m.rank is not None and now - m.last_seen <= cfg.heartbeat_timeout_s
    ]
    stalled = [m for m in alive if now - m.last_progress > bound]
    if not stalled:
        return None
    if len(alive) > 1 and len(stalled) == len(alive):
        low = min(m.step for m in stalled)
        laggards = [m for m in stalled if m.step == low]
        if len(laggards) < len(stalled):
            return Hang(laggards, False, bound)
        return Hang(stalled, True, bound)
    return Hang(stalled, False, bound)


def straggler_ranks(
    step_times: Mapping[int, Sequence[float]], cfg: DetectorConfig
) -> dict[int, dict[str, float]]:
    """Ranks whose median step time is far above the other ranks' (robust statistics).

    For each rank: reference = median of the other ranks' medians, spread = their MAD.
    A rank is slow when its median is >= ``straggler_ratio`` x the reference AND above it by
    more than ``straggler_mad_k`` robust standard deviations (1.4826 x MAD). Medians over a
    window of steps make one slow step irrelevant; ±10% noise never reaches 1.3x.
    """
    medians = {
        r: statistics.median(v[-cfg.straggler_window :])
        for r, v in step_times.items()
        if len(v) >= cfg.straggler_min_samples
    }
    if len(medians) < 2:
        return {}
    out: dict[int, dict[str, float]] = {}
    for rank, med in medians.items():
        others = [m for r, m in medians.items() if r != rank]
        ref = statistics.median(others)
        if ref <= 0:
            continue
        mad = statistics.median(abs(m - ref) for m in others)
        ratio = med / ref
        if ratio >= cfg.straggler_ratio and med - ref > cfg.straggler_mad_k * 1.4826 * mad:
            out[rank] = {
                "median_step_s": round(med, 6),
                "job_median_step_s": round(ref, 6),
                "ratio": round(ratio, 3),
                "mad_s": round(mad, 6),
            }
    return out


class StragglerTracker:
    """Flags a rank only after it has been slow for ``straggler_sustain_s`` in a row."""

    def __init__(self) -> None:
        self.since: dict[int, float] = {}

    def update(
        self, slow: Mapping[int, dict[str, float]], now: float, cfg: DetectorConfig
    ) -> dict[int, dict[str, float]]:
        """Ranks slow for long enough, with their evidence (and how long)."""
        for rank in list(self.since):
            if rank not in slow:
                del self.since[rank]
        out = {}
        for rank, ev in slow.items():
            start = self.since.setdefault(rank, now)
            if now - start >= cfg.straggler_sustain_s:
                out[rank] = {**ev, "sustained_s": round(now - start, 3)}
        return out


__all__ = [
    "HEALTH_RANK",
    "OUT_OF_SERVICE",
    "RECOVERY_ACTION_KINDS",
    "TAXONOMY",
    "XID_KINDS",
    "CounterWindow",
    "Decision",
    "DetectorConfig",
    "Episode",
    "EventSeconds",
    "Finding",
    "GpuWindows",
    "Hang",
    "MemberProgress",
    "StragglerTracker",
    "TaxonomyRow",
    "breaker_allows",
    "decide",
    "episode_step",
    "evaluate_sample",
    "hang_bound",
    "hung_members",
    "lemon_update",
    "lemon_weight",
    "lost_members",
    "straggler_ranks",
    "worse",
]
