"""``python -m tests.bench [names...]``: run the benchmarks, write bench-results/<name>.json.

Each benchmark is a module ``tests/bench/<name>.py`` with ``run() -> dict``. They run one after
another, each in its own child process (so a crash or a hang in one cannot take the others
down; a hang is cut at ``TORCHRELAY_BENCH_TIMEOUT_S``, default 600 s). The order is fixed:
migration first, so that goodput reads this run's measured stall, then goodput, control_plane,
then the other engineers' modules and any others found, alphabetically. A module that raises is
reported as failed in the table, the runner goes on, and it exits 1 at the end.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ORDER = (
    "migration",
    "goodput",
    "control_plane",
    "agent",
    "agent_overhead",
    "detector",
    "spare_pool",
    "billing",
    "api",
)


def results_dir() -> Path:
    """Where the JSON files go: ``TORCHRELAY_BENCH_RESULTS`` or ``./bench-results``."""
    return Path(os.environ.get("TORCHRELAY_BENCH_RESULTS", "bench-results"))


def discover() -> list[str]:
    """Benchmark module names in run order."""
    found = {
        p.stem
        for p in BENCH_DIR.glob("*.py")
        if not p.stem.startswith("_") and p.stem not in {"conftest"}
    }
    ordered = [name for name in ORDER if name in found]
    return ordered + sorted(found - set(ordered))


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _clean(value: Any) -> Any:
    """JSON has no inf/nan: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def run_one(name: str, out: Path) -> int:
    """Child side: import ``tests.bench.<name>``, call ``run()``, write its dict to ``out``."""
    try:
        module = importlib.import_module(f"tests.bench.{name}")
        run = getattr(module, "run", None)
        if not callable(run):
            raise TypeError(f"tests/bench/{name}.py has no run() -> dict")
        result = run()
        if not isinstance(result, dict):
            raise TypeError(f"tests.bench.{name}.run() returned {type(result).__name__}, not dict")
        payload = json.loads(json.dumps(_clean(result), default=_json_default))
        out.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        return 0
    except BaseException as exc:  # the parent reports any failure, whatever it is
        err = "".join(traceback.format_exception(exc))
        print(err, file=sys.stderr, flush=True)
        out.with_suffix(".error").write_text(err)
        return 1


def _headline(result: dict[str, Any]) -> str:
    summary = result.get("summary")
    if isinstance(summary, str):
        return summary
    scalars = [
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in result.items()
        if isinstance(v, int | float | str | bool) and len(str(v)) < 40
    ]
    return ", ".join(scalars[:4])


def main(argv: list[str] | None = None) -> int:
    """Run the named (or all) benchmarks and print the summary table."""
    parser = argparse.ArgumentParser(prog="python -m tests.bench", description=__doc__)
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return run_one(args.one, Path(args.out))

    available = discover()
    names = args.names or available
    unknown = [n for n in names if n not in available]
    if unknown:
        print(
            f"unknown benchmark(s): {', '.join(unknown)}; available: {', '.join(available)}",
            file=sys.stderr,
        )
        return 2
    out_dir = results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    timeout_s = float(os.environ.get("TORCHRELAY_BENCH_TIMEOUT_S", "600"))
    rows: list[tuple[str, str, float, str]] = []
    started = time.monotonic()
    for name in names:
        print(f"\n=== bench: {name} ===", flush=True)
        out = out_dir / f"{name}.json"
        err = out.with_suffix(".error")
        for stale in (out, err):
            stale.unlink(missing_ok=True)
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.bench", "--one", name, "--out", str(out)],
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = -1
        elapsed = time.monotonic() - t0
        if code == 0 and out.exists():
            result = json.loads(out.read_text())
            rows.append((name, "ok", elapsed, _headline(result)))
        elif code == -1:
            rows.append((name, "FAILED", elapsed, f"timed out after {timeout_s:.0f} s"))
        else:
            last = err.read_text().strip().splitlines()[-1] if err.exists() else f"exit {code}"
            rows.append((name, "FAILED", elapsed, last))
    total = time.monotonic() - started
    print(f"\n{'benchmark':<16} {'status':<7} {'seconds':>8}  result")
    for name, status, secs, line in rows:
        print(f"{name:<16} {status:<7} {secs:>8.1f}  {line}")
    print(f"total {total:.1f} s; JSON in {out_dir}/")
    return 1 if any(status != "ok" for _, status, _, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
