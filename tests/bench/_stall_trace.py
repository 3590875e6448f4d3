"""Where a SIGKILL stall goes: the migration bench's torchrelay arm once, with a timeline.

``python -m tests.bench._stall_trace`` runs the faulty torchrelay job of
``tests.bench.migration`` (its own stack, a hot spare, SIGKILL of rank 2 at step 50) with
``TORCHRELAY_AGENT_TIMELINE`` (each member's recovery phases) and ``TORCHRELAY_TRACE_FILE``
(every service's spans) set, and prints the events from just before the kill to one second
after it, in milliseconds from the kill, beside the stall the bench would report. Not a
benchmark (the leading underscore keeps it out of ``make bench``): a tool for the stall target.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from datetime import datetime
from pathlib import Path

from tests.bench import migration as m


def _events(root: Path, log_dir: Path) -> list[tuple[float, str]]:
    events: list[tuple[float, str]] = []
    for rank in range(m.WORLD):
        path = log_dir / f"rank{rank}.log"
        if not path.exists():
            continue
        rows = [line.split() for line in path.read_text().splitlines()]
        commits = [(int(r[1]), float(r[2])) for r in rows if len(r) == 3 and r[0] == "commit"]
        events += [
            (float(r[2]), f"rank{rank} killed at step {r[1]}") for r in rows if r[:1] == ["killed"]
        ]
        for (_, t0), (step, t1) in itertools.pairwise(commits):
            if abs(step - m.KILL_STEP) <= 1:
                events.append((t1, f"rank{rank} commit {step} (gap {1000 * (t1 - t0):.0f} ms)"))
    for path in (root / "timeline").glob("*.timeline"):
        for line in path.read_text().splitlines():
            mark = json.loads(line)
            rest = {k: v for k, v in mark.items() if k not in ("t", "event")}
            events.append((mark["t"], f"{path.stem} {mark['event']} {rest}"))
    trace = root / "trace.jsonl"
    if trace.exists():
        for line in trace.read_text().splitlines():
            span = json.loads(line)
            if "heartbeat" in span["name"] or "telemetry" in span["name"]:
                continue
            took = (span["end"] - span["start"]) / 1e6
            events.append(
                (span["start"] / 1e9, f"  {span['service']}: {span['name']} ({took:.1f} ms)")
            )
    for path in (root / "fault" / "stack" / "logs").glob("*.log"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
                at = datetime.fromisoformat(entry["ts"]).timestamp()
            except (ValueError, KeyError, TypeError):
                continue
            events.append((at, f"[{path.stem}] {str(entry.get('msg', ''))[:90]}"))
    return events


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="tr-stall-trace-"))
    (root / "timeline").mkdir()
    os.environ["TORCHRELAY_AGENT_TIMELINE"] = str(root / "timeline")
    os.environ["TORCHRELAY_TRACE_FILE"] = str(root / "trace.jsonl")
    wall, log_dir, _notes = m.run_torchrelay(root / "fault", True)
    stats = m.analyse(log_dir, m.WORLD, m.KILL_RANK)
    print(
        f"stall {1000 * stats.stall_s:.0f} ms (largest gap of the run "
        f"{1000 * stats.max_gap_s:.0f} ms), lost steps {stats.lost_steps}, wall {wall:.1f} s"
    )
    events = _events(root, log_dir)
    kills = [t for t, text in events if "killed" in text]
    if not kills:
        print(f"no kill recorded; files under {root}")
        return
    for at, text in sorted(events):
        if kills[0] - 0.2 <= at <= kills[0] + 1.0:
            print(f"{1000 * (at - kills[0]):8.1f} ms  {text}")
    print(f"files under {root}")


if __name__ == "__main__":
    main()
