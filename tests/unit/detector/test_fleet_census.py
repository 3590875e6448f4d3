"""The fleet census behind the torchrelay_nodes/torchrelay_gpus gauges (a pure function)."""

from __future__ import annotations

from services.detector.inventory import fleet_census
from torchrelay.contract import NodeHealth


def gpus(n: int) -> dict[str, object]:
    return {"last_seen": 0.0, "gpus": [{"gpu": g} for g in range(n)]}


def test_nodes_and_gpus_are_counted_by_the_health_of_their_node() -> None:
    census = fleet_census(
        {"a": gpus(8), "b": gpus(8), "c": gpus(4)},
        {"b": NodeHealth.QUARANTINED, "c": NodeHealth.HEALTHY},
    )
    assert census[NodeHealth.HEALTHY] == (2, 12)
    assert census[NodeHealth.QUARANTINED] == (1, 8)


def test_every_health_state_is_present_so_a_panel_shows_zero_not_a_gap() -> None:
    census = fleet_census({"a": gpus(2)}, {})
    assert set(census) == set(NodeHealth)
    assert census[NodeHealth.LEMON] == (0, 0)


def test_a_node_known_only_by_its_health_counts_with_no_gpus() -> None:
    census = fleet_census({}, {"gone": NodeHealth.UNHEALTHY})
    assert census[NodeHealth.UNHEALTHY] == (1, 0)
    assert sum(nodes for nodes, _ in census.values()) == 1
