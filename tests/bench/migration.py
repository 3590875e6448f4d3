"""Migration bench: one rank SIGKILLed mid-training, recovered three ways in the same invocation.

The job: 4 data-parallel CPU ranks (gloo) of a 2.4M-parameter MLP with AdamW
(``workloads/common.py``), ``STEPS`` steps; rank ``KILL_RANK`` SIGKILLs itself after the forward
pass of step ``KILL_STEP``. Each system runs once without the fault and three times
(``TORCHRELAY_BENCH_FAULT_RUNS``) with it:

- ``torchrelay``: the whole control plane (``torchrelay up --detach``) and
  ``torchrelay run --nproc 4 --spares 1``; the detector, scheduler and executor hand the dead
  rank to the hot spare, which receives the live state from a survivor.
- ``torchft`` (0.2.0): four replica groups of one rank, a lighthouse, torchft's DDP and
  optimizer wrappers (its ``train_ddp.py`` set-up for CPU); the killed replica is restarted at
  once and heals from a peer.
- ``checkpoint_restart``: ``torchrun --max-restarts``; rank 0 checkpoints to local disk every
  ``CKPT_EVERY`` steps; a dead rank makes torchrun restart every worker from the checkpoint.

Every arm's processes run with ``THP_MEM_ALLOC_ENABLE=1`` (what ``torchrelay run`` gives its
processes by default), so that the arms differ in how they recover, not in their allocator.

Figures per system: ``stall_s`` (the stall of the kill: on each surviving rank, the gap
between its commit of step ``KILL_STEP - 1`` and its next commit, recovery included; the
largest over the survivors; the median over the runs with the kill, each run's in
``stall_runs_s``), ``max_gap_s`` (the largest gap between consecutive commits anywhere in
those runs, for the noise: the fault-free run's own is ``clean_max_gap_s``), ``lost_steps``
(step computations a survivor began and had to redo; the most of any run), ``wall_s``
(median wall time of the runs with the kill, start to finish), ``equal_final`` (sha256 of
model + optimizer state after every run with the kill equal to the fault-free run's).
``ratios`` divide each system's figure by torchrelay's.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = Path(os.environ.get("TORCHRELAY_BENCH_RESULTS", "bench-results"))
WORLD = 4
STEPS = 100
KILL_STEP = 50
KILL_RANK = 2
CKPT_EVERY = 20
# Runs with the kill per system; the median stall is reported, every run's is printed.
FAULT_RUNS_ENV = "TORCHRELAY_BENCH_FAULT_RUNS"


def fault_runs_from(environ: dict[str, str] | os._Environ[str]) -> int:
    """How many runs with the kill per system (``TORCHRELAY_BENCH_FAULT_RUNS``, default 3)."""
    raw = environ.get(FAULT_RUNS_ENV, "3")
    try:
        runs = int(raw)
    except ValueError:
        runs = 0
    if runs < 1:
        raise ValueError(f"{FAULT_RUNS_ENV} must be a whole number of runs >= 1, got {raw!r}")
    return runs


RUN_TIMEOUT_S = 240.0


class ArmUnavailable(RuntimeError):
    """A system cannot run on this checkout; the message says what is missing."""


@dataclass(frozen=True)
class StepStats:
    """What the step logs of one run say."""

    stall_s: float
    max_gap_s: float
    lost_steps: int
    committed: int
    final_sha: dict[int, str]


def analyse(log_dir: Path, world: int, victim: int, kill_step: int = KILL_STEP) -> StepStats:
    """Read ``rank<r>.log`` / ``final<r>.json`` of a run.

    The stall of the kill is, per survivor, the gap between its first commit of step
    ``kill_step - 1`` (the last step the victim committed before it died in ``kill_step``)
    and its next commit, whichever step that is: the step the failure interrupted, recovery
    included (after a rollback, the first step committed again). The largest over survivors
    is reported. ``max_gap_s`` is the largest gap between consecutive commits anywhere in the
    run on any survivor: on a shared 2-core machine a fault-free step sometimes takes as
    long, so it says how noisy the run was, not what the kill cost. A run without a victim
    reports its largest gap as both. Lost steps are, per survivor, the step computations
    begun minus the distinct steps committed (a step abandoned in flight or recomputed after
    a rollback counts once per extra attempt); the maximum over survivors is reported.
    """
    if victim >= 0 and not (log_dir / "killed").exists():
        raise RuntimeError(f"rank {victim} was to be killed but {log_dir / 'killed'} is missing")
    stall = 0.0
    max_gap = 0.0
    lost = 0
    committed = 0
    for rank in range(world):
        path = log_dir / f"rank{rank}.log"
        if not path.exists():
            raise RuntimeError(f"rank {rank} wrote no step log ({path}); see the run's output")
        begins = 0
        commits: list[tuple[int, float]] = []
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 3:
                continue
            kind, step, at = parts[0], int(parts[1]), float(parts[2])
            if kind == "begin":
                begins += 1
            elif kind == "commit":
                commits.append((step, at))
        if rank == victim:
            continue
        steps = {step for step, _ in commits}
        gaps = [b - a for (_, a), (_, b) in itertools.pairwise(commits)]
        max_gap = max(max_gap, *gaps) if gaps else max_gap
        if victim < 0:
            stall = max_gap
        else:
            before = next((i for i, (step, _) in enumerate(commits) if step == kill_step - 1), None)
            if before is None or before + 1 >= len(commits):
                raise RuntimeError(
                    f"rank {rank} committed no step after step {kill_step - 1}; see {path}"
                )
            stall = max(stall, commits[before + 1][1] - commits[before][1])
        lost = max(lost, begins - len(steps))
        committed = max(committed, len(steps))
    finals: dict[int, str] = {}
    for rank in range(world):
        path = log_dir / f"final{rank}.json"
        if path.exists():
            finals[rank] = json.loads(path.read_text())["sha256"]
    return StepStats(
        stall_s=stall, max_gap_s=max_gap, lost_steps=lost, committed=committed, final_sha=finals
    )


def _env(log_dir: Path, fault: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        BENCH_LOG_DIR=str(log_dir),
        BENCH_KILL_RANK=str(KILL_RANK if fault else -1),
        BENCH_KILL_STEP=str(KILL_STEP),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
        # What `torchrelay run` gives its processes by default (launcher.PROCESS_DEFAULTS),
        # given to every arm alike so that the comparison is of recovery, not of allocators.
        THP_MEM_ALLOC_ENABLE="1",
    )
    return env


def _run_logged(
    cmd: list[str], env: dict[str, str], out: Path, timeout: float, *, check: bool = True
) -> tuple[float, int]:
    """Run ``cmd`` to completion (its own session, output to ``out``); (wall time, exit code)."""
    t0 = time.monotonic()
    with out.open("ab") as sink:
        proc = subprocess.Popen(
            cmd, env=env, cwd=REPO, stdout=sink, stderr=sink, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(
                f"{' '.join(cmd[:4])} ... did not finish in {timeout:.0f} s; see {out}"
            ) from None
    wall = time.monotonic() - t0
    if code != 0 and check:
        tail = out.read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {code}: {' | '.join(tail)}")
    return wall, code


# ---------------------------------------------------------------- checkpoint-restart (torchrun)


def run_checkpoint_restart(work: Path, fault: bool) -> tuple[float, Path, dict[str, Any]]:
    """One torchrun job; returns (wall seconds, log dir)."""
    log_dir = work / "log"
    ckpt_dir = work / "ckpt"
    log_dir.mkdir(parents=True)
    ckpt_dir.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={WORLD}",
        "--max-restarts=3",
        "-m",
        "tests.bench.workloads.ckpt_restart",
        "--steps",
        str(STEPS),
        "--every",
        str(CKPT_EVERY),
        "--ckpt-dir",
        str(ckpt_dir),
    ]
    wall, _ = _run_logged(cmd, _env(log_dir, fault), work / "output.txt", RUN_TIMEOUT_S)
    return wall, log_dir, {}


# ---------------------------------------------------------------- torchft


def run_torchft(work: Path, fault: bool) -> tuple[float, Path, dict[str, Any]]:
    """Four torchft replica groups and a lighthouse; the killed replica restarts at once."""
    # torchft's Rust side logs every quorum at INFO; keep the bench's output readable.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        from torchft.coordination import LighthouseServer  # type: ignore[import-untyped,unused-ignore]
    except ImportError as exc:
        raise ArmUnavailable(
            f"torchft is not installed ({exc}); pip install torchft==0.2.0 -c constraints/dev.txt"
        ) from exc
    log_dir = work / "log"
    log_dir.mkdir(parents=True)
    # torchft's README settings for a local run: min 1 replica, 100 ms quorum tick, 10 s join.
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=10_000, quorum_tick_ms=100
    )
    env = _env(log_dir, fault)
    env["TORCHFT_LIGHTHOUSE"] = lighthouse.address()
    cmd = [
        sys.executable,
        "-m",
        "tests.bench.workloads.torchft_replica",
        "--steps",
        str(STEPS),
        "--replicas",
        str(WORLD),
    ]
    out = work / "output.txt"
    procs: dict[int, subprocess.Popen[bytes]] = {}
    restarted = False

    def spawn(replica: int, again: bool) -> None:
        replica_env = dict(env, BENCH_REPLICA=str(replica))
        if again:
            replica_env["BENCH_RESTARTED"] = "1"
        with out.open("ab") as sink:
            procs[replica] = subprocess.Popen(
                cmd, env=replica_env, cwd=REPO, stdout=sink, stderr=sink, start_new_session=True
            )

    t0 = time.monotonic()
    try:
        for replica in range(WORLD):
            spawn(replica, again=False)
        deadline = t0 + RUN_TIMEOUT_S
        while True:
            codes = {r: p.poll() for r, p in procs.items()}
            for replica, code in codes.items():
                if code == -signal.SIGKILL and replica == KILL_RANK and fault and not restarted:
                    restarted = True  # torchft's model: the scheduler restarts it at once
                    spawn(replica, again=True)
                elif code not in (None, 0):
                    raise RuntimeError(f"torchft replica {replica} exited {code}; see {out}")
            if all(p.poll() == 0 for p in procs.values()):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"torchft run did not finish in {RUN_TIMEOUT_S:.0f} s; see {out}"
                )
            time.sleep(0.01)
        wall = time.monotonic() - t0
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        lighthouse.shutdown()
    if fault and not restarted:
        raise RuntimeError(f"the torchft victim never died; see {out}")
    return wall, log_dir, {}


# ---------------------------------------------------------------- torchrelay


def _relay_missing() -> list[str]:
    missing = []
    for module, what in [
        ("torchrelay.launcher", "libs/torchrelay/launcher (torchrelay run)"),
        ("torchrelay.agent", "libs/torchrelay/agent (torchrelay.init)"),
    ]:
        try:
            __import__(module)
        except ImportError as exc:
            missing.append(f"{what}: {exc}")
    for service in ("detector", "scheduler", "spare_pool", "migration_executor"):
        if not (REPO / "services" / service / "__main__.py").exists():
            missing.append(f"services/{service}/__main__.py")
    return missing


class RelayStack:
    """``torchrelay up --detach`` in a temporary state directory, and ``down`` after."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def __enter__(self) -> RelayStack:
        code = subprocess.run(
            [
                sys.executable,
                "-m",
                "torchrelay.cli",
                "up",
                "--detach",
                "--state-dir",
                str(self.state_dir),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if code.returncode != 0:
            raise RuntimeError(
                f"torchrelay up failed ({code.returncode}): {code.stderr.strip() or code.stdout}"
            )
        return self

    def __exit__(self, *_exc: object) -> None:
        subprocess.run(
            [sys.executable, "-m", "torchrelay.cli", "down", "--state-dir", str(self.state_dir)],
            cwd=REPO,
            capture_output=True,
            timeout=60,
            check=False,
        )


def run_torchrelay(work: Path, fault: bool) -> tuple[float, Path, dict[str, Any]]:
    """``torchrelay run --nproc 4 --spares 1`` against a stack of its own.

    Each run gets a fresh stack (as each torchft run gets a fresh lighthouse), so that what the
    control plane does after the fault-free job ends cannot touch the faulty run.
    """
    log_dir = work / "log"
    log_dir.mkdir(parents=True)
    stack_dir = work / "stack"
    with RelayStack(stack_dir):
        return _relay_job(work, log_dir, fault, stack_dir)


def _relay_job(
    work: Path, log_dir: Path, fault: bool, stack_dir: Path
) -> tuple[float, Path, dict[str, Any]]:
    env = _env(log_dir, fault)
    env["TORCHRELAY_HOME"] = str(stack_dir)
    env.pop("NATS_URL", None)
    job_id = f"bench-{'fault' if fault else 'clean'}-{os.getpid()}"
    cmd = [
        sys.executable,
        "-m",
        "torchrelay.cli",
        "run",
        "--nproc",
        str(WORLD),
        "--spares",
        "1",
        "--job-id",
        job_id,
        str(REPO / "tests" / "bench" / "workloads" / "relay_train.py"),
        "--",
        "--steps",
        str(STEPS),
    ]
    out = work / "output.txt"
    wall, code = _run_logged(cmd, env, out, RUN_TIMEOUT_S, check=False)
    notes: dict[str, Any] = {"launcher_exit_code": code}
    if code != 0:
        # The figures stand only if every rank still finished and wrote its final state; the
        # launcher's verdict (e.g. a process that crashed while exiting) is reported beside them.
        finals = [log_dir / f"final{r}.json" for r in range(WORLD)]
        if not all(f.exists() for f in finals):
            tail = out.read_text(errors="replace").strip().splitlines()[-8:]
            raise RuntimeError(f"torchrelay run exited {code}: {' | '.join(tail)}")
        notes["launcher_verdict"] = [
            line.strip()
            for line in out.read_text(errors="replace").splitlines()
            if line.startswith("torchrelay run:") and ("lost" in line or "failed" in line)
        ]
    return wall, log_dir, notes


# ---------------------------------------------------------------- the bench


def _measure(
    name: str,
    runner: Callable[[Path, bool], tuple[float, Path, dict[str, Any]]],
    root: Path,
    fault_runs: int | None = None,
) -> dict[str, Any]:
    """One fault-free run of ``name`` and ``fault_runs`` runs with the kill (median reported).

    On a shared 2-core machine one run's stall is one sample of a noisy quantity (a normal
    step's own gaps vary by 2-4x): the median of several, each printed, says more.
    """
    runs_wanted = fault_runs_from(os.environ) if fault_runs is None else fault_runs
    figures: dict[str, Any] = {"fault_runs": runs_wanted}
    print(f"  {name}: fault-free ...", flush=True)
    wall, log_dir, notes = runner(root / name / "clean", False)
    clean = analyse(log_dir, WORLD, -1)
    if clean.committed != STEPS:
        raise RuntimeError(f"{name}: the ranks committed {clean.committed} of {STEPS} steps")
    figures.update(clean_wall_s=wall, clean_max_gap_s=clean.max_gap_s)
    if notes:
        figures["clean_notes"] = notes
    faults: list[StepStats] = []
    walls: list[float] = []
    fault_notes: list[dict[str, Any]] = []
    for i in range(runs_wanted):
        print(
            f"  {name}: SIGKILL rank {KILL_RANK} at step {KILL_STEP} "
            f"(run {i + 1} of {runs_wanted}) ...",
            flush=True,
        )
        wall, log_dir, notes = runner(root / name / f"fault{i}", True)
        stats = analyse(log_dir, WORLD, KILL_RANK, KILL_STEP)
        if stats.committed != STEPS:
            raise RuntimeError(f"{name}: survivors committed {stats.committed} of {STEPS} steps")
        faults.append(stats)
        walls.append(wall)
        if notes:
            fault_notes.append(notes)
    stalls = [f.stall_s for f in faults]
    figures.update(
        stall_s=statistics.median(stalls),
        stall_runs_s=stalls,
        max_gap_s=max(f.max_gap_s for f in faults),
        lost_steps=max(f.lost_steps for f in faults),
        wall_s=statistics.median(walls),
    )
    if fault_notes:
        figures["fault_notes"] = fault_notes
    clean0 = clean.final_sha.get(0)
    fault0 = [f.final_sha.get(0) for f in faults]
    figures["equal_final"] = bool(clean0) and all(sha == clean0 for sha in fault0)
    figures["ranks_agree_after_fault"] = all(len(set(f.final_sha.values())) == 1 for f in faults)
    figures["final_sha256_rank0"] = {"clean": clean0, "fault": fault0}
    return figures


def run() -> dict[str, Any]:
    """Run the three systems, print a table, return the figures (torchrelay must be there)."""
    fault_runs_from(os.environ)  # a bad setting is refused before minutes of runs
    root = Path(tempfile.mkdtemp(prefix="tr-bench-migration-"))
    systems: dict[str, Any] = {}
    errors: dict[str, str] = {}
    try:
        missing = _relay_missing()
        if missing:
            errors["torchrelay"] = "not available yet: " + "; ".join(missing)
        else:
            try:
                systems["torchrelay"] = _measure("torchrelay", run_torchrelay, root)
            except Exception as exc:
                errors["torchrelay"] = f"{type(exc).__name__}: {exc}"
        for name, runner in (
            ("torchft", run_torchft),
            ("checkpoint_restart", run_checkpoint_restart),
        ):
            try:
                systems[name] = _measure(name, runner, root)
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
    finally:
        if not errors:
            shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = {
        "setup": {
            "world_size": WORLD,
            "steps": STEPS,
            "kill_rank": KILL_RANK,
            "kill_step": KILL_STEP,
            "checkpoint_every": CKPT_EVERY,
            "model": "MLP 512-1536-1024-16 (2,378,256 parameters), AdamW, gloo on CPU",
        },
        "systems": systems,
        "errors": errors,
    }
    relay = systems.get("torchrelay")
    if relay:
        result["ratios"] = {
            name: {
                "stall": fig["stall_s"] / relay["stall_s"] if relay["stall_s"] else None,
                "wall": fig["wall_s"] / relay["wall_s"],
                "extra_lost_steps": fig["lost_steps"] - relay["lost_steps"],
            }
            for name, fig in systems.items()
            if name != "torchrelay"
        }
    print(
        f"{'system':<20} {'stall s':>8} {'max gap':>8} {'clean gap':>9} {'lost':>5} "
        f"{'wall s':>8} {'clean wall':>10}  equal_final  stall of each run"
    )
    for name in ("torchrelay", "torchft", "checkpoint_restart"):
        fig = systems.get(name)
        if fig is None:
            print(f"{name:<20} FAILED: {errors.get(name)}")
            continue
        print(
            f"{name:<20} {fig['stall_s']:>8.3f} {fig['max_gap_s']:>8.3f} "
            f"{fig['clean_max_gap_s']:>9.3f} {fig['lost_steps']:>5} {fig['wall_s']:>8.1f} "
            f"{fig['clean_wall_s']:>10.1f}  {fig['equal_final']!s:<11}  "
            + " ".join(f"{x:.3f}" for x in fig["stall_runs_s"])
        )
    if errors:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        partial = RESULTS_DIR / "migration.partial.json"
        partial.write_text(json.dumps(result, indent=2) + "\n")
        raise RuntimeError(
            "; ".join(f"{k}: {v}" for k, v in errors.items())
            + f" (the other systems' figures are in {partial}; run files kept in {root})"
        )
    if relay:
        runs = ", ".join(f"{x:.3f}" for x in relay["stall_runs_s"])
        parts = [
            f"torchrelay stall {relay['stall_s']:.3f} s (median of {len(relay['stall_runs_s'])}"
            f" runs: {runs}; largest gap of the runs {relay['max_gap_s']:.3f} s, fault-free "
            f"{relay['clean_max_gap_s']:.3f} s)"
        ]
        parts += [
            f"{n} {systems[n]['stall_s']:.2f} s ({result['ratios'][n]['stall']:.0f}x)"
            for n in ("torchft", "checkpoint_restart")
        ]
        result["summary"] = ", ".join(parts) + f"; relay equal_final={relay['equal_final']}"
    return result


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
