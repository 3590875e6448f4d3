"""The node inventory: each node's GPUs as last seen, written to Redis for the RPC verbs.

``ingest.py`` keeps each GPU's last routine sample in memory (``latest``, scalars only) and
marks its node dirty; a node seen for the first time is written at once (it counts for the
circuit breaker), the rest every ``detector_inventory_interval_s``, in chunks. One replica
also counts the fleet from Redis into the ``torchrelay_nodes``/``torchrelay_gpus`` gauges.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from services.detector.core import DetectorCore
from torchrelay.contract import NodeHealth

INVENTORY_CHUNK = 100  # nodes encoded and written per step of an inventory flush
# A typical Prometheus scrape interval: counting more often is not seen, and each count
# reads a cluster's whole inventory.
FLEET_GAUGE_INTERVAL_S = 15.0
# The replica that counts the fleet is the owner of this key (Membership.owner).
FLEET_GAUGE_OWNER_KEY = "fleet-gauges"


def fleet_census(
    inventory: Mapping[str, Mapping[str, Any]], health: Mapping[str, NodeHealth]
) -> dict[NodeHealth, tuple[int, int]]:
    """``health -> (nodes, gpus)`` of one cluster, every health state present (0 if none).

    Args:
        inventory: node -> its inventory summary (``gpus``: the GPUs last seen).
        health: node -> health, for the nodes whose health ever changed; a node missing
            from it is healthy, and a node only in it (no inventory) has no GPUs seen.
    """
    counts = {h: [0, 0] for h in NodeHealth}
    for node in set(inventory) | set(health):
        row = counts[health.get(node, NodeHealth.HEALTHY)]
        row[0] += 1
        row[1] += len((inventory.get(node) or {}).get("gpus") or [])
    return {h: (nodes, gpus) for h, (nodes, gpus) in counts.items()}


class InventoryMixin(DetectorCore):
    """The periodic (and first-sight) inventory write."""

    async def _inventory_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.detector_inventory_interval_s)
            try:
                await self._flush_inventory()
            except Exception as exc:
                self.log.warning("inventory flush failed: %r", exc)

    async def _fleet_gauge_loop(self) -> None:
        while True:
            try:
                await self.refresh_fleet_gauges()
            except Exception as exc:
                self.log.warning("fleet gauge refresh failed: %r", exc)
            await asyncio.sleep(FLEET_GAUGE_INTERVAL_S)

    async def refresh_fleet_gauges(self) -> None:
        """Count every cluster's nodes and GPUs by health, on the owning replica only.

        Every replica would read the same Redis, so one reads it; the others export nothing
        (cleared), and a dashboard's ``max by (cluster, health)`` sees one value.
        """
        if self.membership.owner(FLEET_GAUGE_OWNER_KEY) != self.membership.replica_id:
            self.m_nodes.clear()
            self.m_gpus.clear()
            return
        for cluster in await self.nodes.clusters():
            census = fleet_census(
                await self.nodes.inventory(cluster), await self.nodes.health_all(cluster)
            )
            for health, (nodes, gpus) in census.items():
                self.m_nodes.labels(cluster, health.value).set(nodes)
                self.m_gpus.labels(cluster, health.value).set(gpus)

    async def _flush_inventory(self, only: set[tuple[str, str]] | None = None) -> None:
        if only is None:
            dirty, self.dirty = self.dirty, set()
        else:
            dirty = only
        now = time.time()
        nodes = list(dirty)
        # In chunks, each written before the next is encoded: 2,000 nodes at once held the
        # event loop (and any XID behind it) for 100-370 ms.
        for start in range(0, len(nodes), INVENTORY_CHUNK):
            by_cluster: dict[str, dict[str, dict[str, Any]]] = {}
            for cluster, node in nodes[start : start + INVENTORY_CHUNK]:
                samples = self.latest.get((cluster, node), {})
                by_cluster.setdefault(cluster, {})[node] = {
                    "last_seen": now,
                    "backend": next((g[0] for g in samples.values()), None),
                    "gpus": [
                        {
                            "gpu": gpu,
                            "model": model,
                            "temperature_c": temperature,
                            "power_w": power,
                            "sample_ts": round(ts, 3),
                            **({"slow_factor": slow} if slow is not None else {}),
                        }
                        for gpu, (_, model, temperature, power, ts, slow) in sorted(samples.items())
                    ],
                }
            for cluster, inv in by_cluster.items():
                await self.nodes.record_inventory(cluster, inv)
