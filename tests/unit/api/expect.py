"""What the API's answers must hold (docs/interfaces.md), and how the dashboard shows it."""

from __future__ import annotations

from collections import Counter
from html.parser import HTMLParser
from typing import Any

JOB = {"job_id", "tenant", "world_size", "spares", "generation", "committed_step", "state", "ranks"}
RANK = {"rank", "node", "gpu", "pid"}
NODE = {"node", "cluster", "health", "lemon_score", "state", "gpus"}
INCIDENT = {
    "incident_id",
    "tenant",
    "job_id",
    "rank",
    "node",
    "gpu",
    "fault_kind",
    "severity",
    "detected_at",
    "resolved_at",
    "resolution",
    "stall_ms",
    "lost_steps",
    "bytes_moved",
    "generation_before",
    "generation_after",
}
GOODPUT = {
    "gpu_seconds_allocated",
    "gpu_seconds_progress",
    "gpu_seconds_lost",
    "ettr",
    "counterfactual",
}
CONTRACT = {
    "contract_id",
    "tenant",
    "term_start",
    "term_end",
    "renewal_fee_minor",
    "currency",
    "threshold",
    "credit_rate",
    "count_proactive",
}
GUARANTEE = {
    "contract_id",
    "term_start",
    "term_end",
    "eligible_failures",
    "resolved_by_migration",
    "prevented_failures",
    "ratio",
    "threshold",
    "met",
    "credit_minor",
    "currency",
    "final",
}
SPARE = {
    "slot_id",
    "cluster",
    "node",
    "gpu",
    "gpu_model",
    "memory_mb",
    "nvlink_domain",
    "rack",
    "zone",
    "state",
}


class _TestIds(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, dict[str, str]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        if "data-testid" in values:
            self.found[values["data-testid"]] = values


def elements_by_testid(html: str) -> dict[str, dict[str, str]]:
    """Every element with a ``data-testid``, by id, with its attributes."""
    parser = _TestIds()
    parser.feed(html)
    return parser.found


def expected_figures(get: Any) -> dict[str, str]:
    """The figures the dashboard must show, computed from the API's own answers."""
    nodes = get("/v1/nodes?limit=500")["items"]
    depth = get("/v1/spares/depth?limit=500")["items"]
    incidents = get("/v1/incidents?limit=500")["items"]
    contracts = get("/v1/contracts?limit=500")["items"]
    out = {
        "nodes-total": str(len(nodes)),
        "spares-total": str(sum(d["available"] for d in depth)),
        "incidents-total": str(len(incidents)),
    }
    for health, count in Counter(n["health"] for n in nodes).items():
        out[f"health-{health}"] = str(count)
    for resolution, count in Counter(i["resolution"] for i in incidents).items():
        out[f"incidents-{resolution}"] = str(count)
    for d in depth:
        out[f"depth-{d['cluster']}-{d['nvlink_domain']}"] = str(d["available"])
    for c in contracts:
        g = get(f"/v1/contracts/{c['contract_id']}/guarantee")
        out[f"guarantee-{c['contract_id']}"] = f"{g['ratio']:.4f}"
    return out


def shown_figures(ids: dict[str, dict[str, str]], keys: set[str]) -> dict[str, str]:
    shown = {}
    for key in keys:
        attrs = ids.get(key, {})
        if key.startswith("guarantee-"):
            shown[key] = attrs.get("data-ratio", "?")
        elif key.startswith("depth-"):
            shown[key] = attrs.get("data-available", "?")
        else:
            shown[key] = attrs.get("data-count", "?")
    return shown
