"""Goodput simulator: what a failure costs a large training job under three recovery strategies.

Failure model (Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research
Clusters", HPCA 2025, arXiv 2410.21680): failures strike nodes independently at a constant rate
``r_f`` per node-day, so a job on ``n`` nodes sees failures as a Poisson process of rate
``n * r_f`` and its mean time to failure is ``MTTF = 1 / (n * r_f)``. With 8 GPUs per node and
``r_f = 6.5`` failures per 1000 node-days this gives the paper's projection: 16,384 GPUs ->
1.80 h, 131,072 GPUs -> 0.225 h (the paper says 1.8 h and 0.23 h).

Strategies, each run for 30 days of wall-clock time on N GPUs:

- ``checkpoint_restart``: a synchronous checkpoint costs ``C`` seconds of stall and is taken
  every ``tau`` seconds of work, ``tau`` at the Young/Daly optimum ``sqrt(2 * C * MTTF)``. A
  failure loses the work since the last checkpoint and costs the restart overhead ``R`` (the
  paper's ``u0``: reschedule, re-initialise, load the checkpoint).
- ``in_job_restart`` (torchft-like): the failed replica group is restarted and healed from a
  peer; no work is rolled back, but every failure costs the job ``H`` seconds.
- ``torchrelay``: the failed rank moves to a hot spare; every failure costs the measured
  stall ``S`` and no rollback, *if* a spare is free. Spares come from a finite pool of ``s``
  nodes; a failed node is repaired in an exponentially distributed time of mean ``MTTR``
  (unlimited repair crews unless ``repair_crews`` is set, i.e. an M/M/inf or M/M/c queue of
  nodes in repair) and then rejoins the pool. When every spare is out, the failure falls back
  to checkpoint-restart; the job still checkpoints, at the Young/Daly interval for the failures
  that fall back (``sqrt(2 * C * MTTF / p_no_spare)``, capped at the horizon).

Numbers used and where they come from:

- ``r_f = 6.5 / 1000`` node-days, 8 GPUs/node: the paper's failure model; the value is the
  one that reproduces the paper's two MTTF projections (checked by a unit test within 5%).
- ``R = u0 = 300 s`` restart overhead: the value the paper uses in its ETTR examples (5 min).
  I could not re-read the paper's text from this machine; treat it as recalled, not quoted.
- ``C = 60 s`` checkpoint stall: ASSUMPTION (a sharded synchronous checkpoint to a parallel
  file system); the paper's own ETTR model focuses on the checkpoint interval, not its cost.
- ``H = 90 s`` in-job restart/heal cost: ASSUMPTION (process restart, communicator
  re-initialisation and a heal from a peer at scale); the migration bench measures torchft's
  CPU stall on a 2M-parameter model, which is a lower bound, not a scale figure.
- ``S``: torchrelay's survivors' stall measured by the migration bench
  (``bench-results/migration.json`` -> ``systems.torchrelay.stall_s``) when that file holds a
  measurement; otherwise ``1.0 s``, an ASSUMPTION labelled as such in the output.
- Spare pool: ``max(2, ceil(1% of the job's nodes))`` spare nodes, ``MTTR = 24 h``:
  ASSUMPTIONS; the output reports ``p_no_spare`` so their effect is visible.

Method: a discrete-event Monte Carlo (numpy ``default_rng`` with a fixed seed, several
replications averaged), cross-checked against closed forms: Daly's exact expectation for
exponential failures, ``E[T] = M * exp(R/M) * (exp((tau + C)/M) - 1)`` per ``tau`` of work, for
checkpoint-restart; ``ETTR = exp(-H/M)`` for in-job restart (a failure during recovery restarts
the recovery); a first-order mix for torchrelay. ETTR here is productive (not rolled back) work
time divided by wall time.
"""

from __future__ import annotations

import heapq
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

HOUR_S = 3600.0
DAY_S = 86400.0

FAILURES_PER_NODE_DAY = 6.5 / 1000.0
GPUS_PER_NODE = 8
PAPER_MTTF_H = {16_384: 1.8, 131_072: 0.23}
SCALES = (1_024, 2_048, 16_384, 131_072)
HORIZON_DAYS = 30.0
SEED = 20250301
REPLICATIONS = 8

RESULTS_DIR = Path(os.environ.get("TORCHRELAY_BENCH_RESULTS", "bench-results"))
DEFAULT_RELAY_STALL_S = 1.0


@dataclass(frozen=True)
class Costs:
    """Per-event costs in seconds, and the spare pool's shape."""

    checkpoint_s: float = 60.0
    restart_s: float = 300.0
    heal_s: float = 90.0
    relay_stall_s: float = DEFAULT_RELAY_STALL_S
    relay_stall_source: str = "assumption (no bench-results/migration.json measurement)"
    spare_fraction: float = 0.01
    min_spares: int = 2
    mttr_s: float = 24 * HOUR_S
    repair_crews: int | None = None


@dataclass(frozen=True)
class Policy:
    """How a simulated job reacts to a failure."""

    name: str
    checkpoint_interval_s: float  # math.inf: never checkpoints
    checkpoint_s: float
    live_cost_s: (
        float | None
    )  # cost of a failure absorbed without rollback; None: always rolls back
    restart_s: float  # cost of a rollback restart
    spares: int | None = None  # None: live recovery never runs out of spares
    mttr_s: float = 24 * HOUR_S
    repair_crews: int | None = None


@dataclass
class RunStats:
    """What one simulated run did."""

    productive_s: float = 0.0
    failures: int = 0
    fallbacks: int = 0
    checkpoints: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def nodes_for(gpus: int) -> int:
    """Nodes a job of ``gpus`` GPUs occupies (8 GPUs per node)."""
    return math.ceil(gpus / GPUS_PER_NODE)


def mttf_s(gpus: int, rate_per_node_day: float = FAILURES_PER_NODE_DAY) -> float:
    """The job's mean time to failure: ``1 / (nodes * r_f)``, in seconds."""
    return DAY_S / (nodes_for(gpus) * rate_per_node_day)


def young_daly_interval_s(checkpoint_s: float, mttf: float) -> float:
    """Young/Daly first-order optimal checkpoint interval ``sqrt(2 * C * MTTF)``."""
    return math.sqrt(2.0 * checkpoint_s * mttf)


def spares_for(gpus: int, costs: Costs) -> int:
    """Spare nodes in the pool that serves a job of ``gpus`` GPUs."""
    return max(costs.min_spares, math.ceil(costs.spare_fraction * nodes_for(gpus)))


def p_no_spare(arrival_rate: float, mttr: float, spares: int, crews: int | None = None) -> float:
    """Probability that a failure finds every spare out for repair.

    Nodes in repair form an M/M/inf queue (``crews`` None: every failed node is repaired at
    once) or an M/M/c queue (``crews`` repair slots); by PASTA a failure sees the stationary
    distribution, and no spare is free when ``spares`` or more nodes are in repair.

    Args:
        arrival_rate: node failures per second.
        mttr: mean repair time in seconds.
        spares: spare nodes in the pool.
        crews: concurrent repairs, or None for unlimited.

    Returns:
        ``P(nodes in repair >= spares)``; 1.0 when an M/M/c queue is unstable.
    """
    load = arrival_rate * mttr  # offered load in Erlangs
    if spares <= 0:
        return 1.0
    if crews is None:
        # Poisson(load): P(N >= s) = 1 - sum_{k<s} e^-a a^k / k!
        term = math.exp(-load)
        below = 0.0
        for k in range(spares):
            below += term
            term *= load / (k + 1)
        return max(0.0, 1.0 - below)
    if load >= crews:
        return 1.0
    # M/M/c stationary distribution, computed with running terms to stay finite.
    terms = [1.0]
    for k in range(1, crews):
        terms.append(terms[-1] * load / k)
    tail_first = terms[-1] * load / crews  # state c
    rho = load / crews
    norm = sum(terms) + tail_first / (1.0 - rho)
    probs_below = [t / norm for t in terms]  # states 0..c-1
    if spares <= crews:
        return max(0.0, 1.0 - sum(probs_below[:spares]))
    # states >= c: tail_first * rho^(k-c) / norm
    return (tail_first / norm) * rho ** (spares - crews) / (1.0 - rho)


class _SparePool:
    """Spares out for repair, tracked event by event."""

    def __init__(self, spares: int, mttr: float, crews: int | None, rng: np.random.Generator):
        self.spares = spares
        self.mttr = mttr
        self.crews = crews
        self.rng = rng
        self.repair_ends: list[float] = []  # heap of times nodes come back
        self.crew_free: list[float] = [0.0] * (crews or 0)

    def take(self, now: float) -> bool:
        """A node failed at ``now``; True when a spare was free to replace it."""
        while self.repair_ends and self.repair_ends[0] <= now:
            heapq.heappop(self.repair_ends)
        free = len(self.repair_ends) < self.spares
        duration = float(self.rng.exponential(self.mttr))
        if self.crews is None:
            end = now + duration
        else:
            start = max(now, heapq.heappop(self.crew_free))
            end = start + duration
            heapq.heappush(self.crew_free, end)
        # The failed node goes to repair either way; it rejoins the pool as a spare.
        heapq.heappush(self.repair_ends, end)
        return free


def simulate(
    policy: Policy, gpus: int, horizon_s: float, rng: np.random.Generator, mttf: float
) -> RunStats:
    """One discrete-event run of ``policy`` on a job of ``gpus`` GPUs for ``horizon_s``.

    Failures form a Poisson process of mean gap ``mttf`` that keeps running through
    checkpoints and recoveries: a failure during a recovery starts that recovery again.
    """
    stats = RunStats()
    pool = (
        _SparePool(policy.spares, policy.mttr_s, policy.repair_crews, rng)
        if policy.spares is not None
        else None
    )
    t = 0.0
    saved = 0.0  # work secured by a checkpoint
    pending = 0.0  # work since the last checkpoint
    next_fail = float(rng.exponential(mttf))

    def recover(at: float) -> float:
        """Handle the failure at ``at`` (and any during its recovery); return when work resumes."""
        nonlocal pending, next_fail
        resume = at
        fail_at = at
        while True:
            stats.failures += 1
            live = policy.live_cost_s is not None and (pool is None or pool.take(fail_at))
            if pool is not None and not live:
                stats.fallbacks += 1
            if live:
                assert policy.live_cost_s is not None
                resume = fail_at + policy.live_cost_s
            else:
                pending = 0.0
                resume = fail_at + policy.restart_s
            next_fail = fail_at + float(rng.exponential(mttf))
            if next_fail >= resume:
                return resume
            fail_at = next_fail

    while t < horizon_s:
        ckpt_due = t + (policy.checkpoint_interval_s - pending)
        stop = min(ckpt_due, next_fail, horizon_s)
        pending += stop - t
        t = stop
        if t >= horizon_s:
            break
        if t == next_fail:
            t = recover(t)
            continue
        # Checkpoint: a stall of checkpoint_s; a failure inside it loses the segment.
        ckpt_end = t + policy.checkpoint_s
        if next_fail < ckpt_end:
            t = recover(next_fail)
            continue
        if ckpt_end >= horizon_s:
            t = horizon_s
            break
        saved += pending
        pending = 0.0
        stats.checkpoints += 1
        t = ckpt_end
    stats.productive_s = saved + pending
    return stats


def policies_for(gpus: int, costs: Costs) -> dict[str, Policy]:
    """The three strategies, tuned for a job of ``gpus`` GPUs."""
    mttf = mttf_s(gpus)
    horizon = HORIZON_DAYS * DAY_S
    spares = spares_for(gpus, costs)
    rate = 1.0 / mttf
    p_block = p_no_spare(rate, costs.mttr_s, spares, costs.repair_crews)
    relay_interval = (
        min(horizon, young_daly_interval_s(costs.checkpoint_s, mttf / p_block))
        if p_block > 0
        else math.inf
    )
    return {
        "checkpoint_restart": Policy(
            name="checkpoint_restart",
            checkpoint_interval_s=young_daly_interval_s(costs.checkpoint_s, mttf),
            checkpoint_s=costs.checkpoint_s,
            live_cost_s=None,
            restart_s=costs.restart_s,
        ),
        "in_job_restart": Policy(
            name="in_job_restart",
            checkpoint_interval_s=math.inf,
            checkpoint_s=0.0,
            live_cost_s=costs.heal_s,
            restart_s=costs.restart_s,
        ),
        "torchrelay": Policy(
            name="torchrelay",
            checkpoint_interval_s=relay_interval,
            checkpoint_s=costs.checkpoint_s,
            live_cost_s=costs.relay_stall_s,
            restart_s=costs.restart_s,
            spares=spares,
            mttr_s=costs.mttr_s,
            repair_crews=costs.repair_crews,
        ),
    }


def closed_form_ettr(policy: Policy, mttf: float, p_block: float = 0.0) -> float:
    """Analytic ETTR of ``policy`` under exponential failures of mean gap ``mttf``.

    Exact (Daly) for pure checkpoint-restart and for pure live recovery; first order in
    ``1/mttf`` for the torchrelay mix of live recoveries and fallbacks.
    """
    m = mttf
    if policy.live_cost_s is None:
        tau, c, r = policy.checkpoint_interval_s, policy.checkpoint_s, policy.restart_s
        return tau / (m * math.exp(r / m) * math.expm1((tau + c) / m))
    if (policy.spares is None or p_block == 0.0) and math.isinf(policy.checkpoint_interval_s):
        return math.exp(-policy.live_cost_s / m)
    tau = policy.checkpoint_interval_s
    ckpt_waste = 0.0 if math.isinf(tau) else policy.checkpoint_s / (tau + policy.checkpoint_s)
    live_waste = (1.0 - p_block) * policy.live_cost_s / m
    rollback_tau = 0.0 if math.isinf(tau) else tau + policy.checkpoint_s
    fallback_waste = p_block * (policy.restart_s + rollback_tau / 2.0) / m
    return max(0.0, 1.0 - ckpt_waste - live_waste - fallback_waste)


def measured_relay_stall(results_dir: Path = RESULTS_DIR) -> tuple[float, str] | None:
    """torchrelay's stall from the migration bench's JSON, if it holds a measurement."""
    path = results_dir / "migration.json"
    try:
        data = json.loads(path.read_text())
        stall = float(data["systems"]["torchrelay"]["stall_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not math.isfinite(stall) or stall <= 0:
        return None
    return stall, f"measured ({path}, systems.torchrelay.stall_s)"


def evaluate(
    costs: Costs,
    scales: tuple[int, ...] = SCALES,
    replications: int = REPLICATIONS,
    seed: int = SEED,
    horizon_days: float = HORIZON_DAYS,
) -> dict[str, Any]:
    """Monte Carlo ETTR and GPU-hours per strategy and scale, with the closed forms beside."""
    rng = np.random.default_rng(seed)
    horizon = horizon_days * DAY_S
    out: dict[str, Any] = {}
    for gpus in scales:
        mttf = mttf_s(gpus)
        spares = spares_for(gpus, costs)
        p_block = p_no_spare(1.0 / mttf, costs.mttr_s, spares, costs.repair_crews)
        row: dict[str, Any] = {
            "mttf_h": mttf / HOUR_S,
            "nodes": nodes_for(gpus),
            "spare_nodes": spares,
            "p_no_spare": p_block,
            "strategies": {},
        }
        for name, policy in policies_for(gpus, costs).items():
            runs = [simulate(policy, gpus, horizon, rng, mttf) for _ in range(replications)]
            ettrs = np.array([r.productive_s / horizon for r in runs])
            ettr = float(ettrs.mean())
            row["strategies"][name] = {
                "ettr": ettr,
                "ettr_stderr": float(ettrs.std(ddof=1) / math.sqrt(len(ettrs))),
                "ettr_closed_form": closed_form_ettr(
                    policy, mttf, p_block if policy.spares is not None else 0.0
                ),
                "checkpoint_interval_s": policy.checkpoint_interval_s
                if math.isfinite(policy.checkpoint_interval_s)
                else None,
                "failures_per_run": float(np.mean([r.failures for r in runs])),
                "fallbacks_per_run": float(np.mean([r.fallbacks for r in runs])),
                "productive_gpu_hours": ettr * gpus * horizon / HOUR_S,
            }
        base = row["strategies"]["checkpoint_restart"]["productive_gpu_hours"]
        for stats in row["strategies"].values():
            stats["gpu_hours_saved_vs_checkpoint_restart"] = stats["productive_gpu_hours"] - base
        out[str(gpus)] = row
    return out


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = [int(k) for k in results]
    names = ["checkpoint_restart", "in_job_restart", "torchrelay"]
    labels = {
        "checkpoint_restart": "checkpoint-restart (Young/Daly)",
        "in_job_restart": "in-job restart (torchft-like)",
        "torchrelay": "torchrelay (finite spare pool)",
    }
    colors = {
        "checkpoint_restart": "tab:blue",
        "in_job_restart": "tab:orange",
        "torchrelay": "tab:green",
    }
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in names:
        ax1.plot(
            scales,
            [results[str(g)]["strategies"][name]["ettr"] for g in scales],
            marker="o",
            color=colors[name],
            label=labels[name],
        )
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(scales, [f"{g:,}" for g in scales])
    ax1.set_xlabel("GPUs in the job")
    ax1.set_ylabel("ETTR (productive / wall time)")
    ax1.set_ylim(0, 1.02)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8, loc="lower left")
    ax1.set_title("ETTR over 30 days, r_f = 6.5 / 1000 node-days")
    width = 0.38
    xs = np.arange(len(scales))
    for i, name in enumerate(["in_job_restart", "torchrelay"]):
        saved = [
            results[str(g)]["strategies"][name]["gpu_hours_saved_vs_checkpoint_restart"] / 1e3
            for g in scales
        ]
        ax2.bar(xs + (i - 0.5) * width, saved, width, color=colors[name], label=labels[name])
    ax2.set_xticks(xs, [f"{g:,}" for g in scales])
    ax2.set_xlabel("GPUs in the job")
    ax2.set_ylabel("GPU-hours saved vs checkpoint-restart (thousands)")
    ax2.set_yscale("log")
    ax2.grid(alpha=0.3, axis="y")
    ax2.legend(fontsize=8, loc="upper left")
    ax2.set_title("GPU-hours saved in 30 days")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run() -> dict[str, Any]:
    """Run the simulator, print a table, write the plot; return the figures."""
    costs = Costs()
    measured = measured_relay_stall()
    if measured is not None:
        costs = replace(costs, relay_stall_s=measured[0], relay_stall_source=measured[1])
    else:
        costs = replace(
            costs,
            relay_stall_source=f"ASSUMPTION: no measurement in {RESULTS_DIR / 'migration.json'}",
        )
    projection = {
        str(g): {
            "mttf_h": mttf_s(g) / HOUR_S,
            "paper_h": paper,
            "rel_error": mttf_s(g) / HOUR_S / paper - 1.0,
        }
        for g, paper in PAPER_MTTF_H.items()
    }
    results = evaluate(costs)
    plot_path = RESULTS_DIR / "goodput.png"
    _plot(results, plot_path)

    print(f"MTTF projection (r_f = {FAILURES_PER_NODE_DAY * 1000:.1f}/1000 node-days, 8 GPU/node)")
    for g, p in projection.items():
        print(
            f"  {int(g):>7,} GPUs: {p['mttf_h']:.3f} h (paper {p['paper_h']} h, "
            f"{p['rel_error']:+.1%})"
        )
    print(
        f"costs: checkpoint {costs.checkpoint_s:.0f} s, restart {costs.restart_s:.0f} s, "
        f"heal {costs.heal_s:.0f} s, torchrelay stall {costs.relay_stall_s:.3f} s "
        f"[{costs.relay_stall_source}]"
    )
    header = f"{'GPUs':>8} {'MTTF h':>7} {'p_nospare':>9}  {'ckpt-restart':>12} {'in-job':>8} "
    print(header + f"{'torchrelay':>10}  {'relay saves GPU-h':>17}")
    for g, row in results.items():
        s = row["strategies"]
        print(
            f"{int(g):>8,} {row['mttf_h']:>7.2f} {row['p_no_spare']:>9.2e}  "
            f"{s['checkpoint_restart']['ettr']:>12.4f} {s['in_job_restart']['ettr']:>8.4f} "
            f"{s['torchrelay']['ettr']:>10.4f}  "
            f"{s['torchrelay']['gpu_hours_saved_vs_checkpoint_restart']:>17,.0f}"
        )
    print(f"plot: {plot_path}")
    big = results[str(SCALES[-1])]["strategies"]
    summary = (
        f"MTTF {projection['16384']['mttf_h']:.2f} h @16k, {projection['131072']['mttf_h']:.3f} h "
        f"@131k; ETTR @131k: ckpt-restart {big['checkpoint_restart']['ettr']:.3f}, in-job "
        f"{big['in_job_restart']['ettr']:.3f}, torchrelay {big['torchrelay']['ettr']:.3f}"
    )
    return {
        "summary": summary,
        "method": (
            f"discrete-event Monte Carlo, numpy default_rng(seed={SEED}), {REPLICATIONS} "
            f"replications of {HORIZON_DAYS:.0f} days per strategy and scale; closed forms beside"
        ),
        "failure_model": {
            "failures_per_node_day": FAILURES_PER_NODE_DAY,
            "gpus_per_node": GPUS_PER_NODE,
            "source": "Kokolis et al., HPCA 2025 (arXiv 2410.21680)",
        },
        "mttf_projection": projection,
        "costs": asdict(costs),
        "scales": results,
        "plot": str(plot_path),
    }


if __name__ == "__main__":
    run()
