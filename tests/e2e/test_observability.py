"""One failure is one trace across the services, and the metrics move with it."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Stack, run_job, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _chain(spans: dict[str, dict[str, Any]], leaf: dict[str, Any]) -> list[str]:
    """Service names from the leaf span up to the root, following parent ids."""
    out = []
    span: dict[str, Any] | None = leaf
    while span is not None:
        out.append(str(span["service"]))
        span = spans.get(span["parent_id"]) if span.get("parent_id") else None
    return out


def test_one_failure_is_one_trace_and_moves_the_counters(stack: Stack, tmp_path: Path) -> None:
    ports = {name: svc["port"] for name, svc in stack.info["services"].items()}
    before = {
        "incidents": _metric(ports["scheduler"], "incidents_total"),
        "stall": _metric(ports["scheduler"], "migration_stall_seconds_count"),
        "reservations": _metric(ports["spare_pool"], "spare_reservations_total"),
    }
    out = tmp_path / "out"
    proc = run_job(
        stack,
        "e2e-traced",
        nproc=3,
        spares=1,
        nodes=2,
        steps=60,
        out=out,
        extra=["--step-sleep", "0.05"],
    )

    def step(n: int) -> bool:
        with stack.api() as api:
            resp = api.get("/v1/jobs/e2e-traced")
            return resp.status_code == 200 and (resp.json().get("committed_step") or -1) >= n

    wait_until(lambda: step(10), 240, "step 10")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torchrelay.cli",
            "chaos",
            "kill",
            "--job",
            "e2e-traced",
            "--rank",
            "1",
        ],
        env=stack.env(),
        check=True,
        timeout=60,
    )
    assert proc.wait(300) == 0

    def billed_trace() -> list[str] | None:
        spans = {s["span_id"]: s for s in stack.traces()}
        for s in spans.values():
            if s["service"] == "billing" and "incident.closed" in s["name"]:
                chain = _chain(spans, s)
                if "detector" in chain and "migration_executor" in chain:
                    return chain
        return None

    chain = wait_until(billed_trace, 60, "a billing span whose trace reaches the detector")
    # Leaf to root: billing <- scheduler <- executor <- scheduler <- detector.
    order = [svc for i, svc in enumerate(chain) if i == 0 or chain[i - 1] != svc]
    assert order.index("billing") < order.index("scheduler")
    assert order.index("scheduler") < order.index("migration_executor")
    assert order.index("migration_executor") < len(order) - 1 - order[::-1].index("scheduler")
    assert order[-1] == "detector"

    wait_until(
        lambda: _metric(ports["scheduler"], "incidents_total") > before["incidents"],
        30,
        "incidents_total to move",
    )
    assert _metric(ports["scheduler"], "migration_stall_seconds_count") > before["stall"]
    assert _metric(ports["spare_pool"], "spare_reservations_total") > before["reservations"]
