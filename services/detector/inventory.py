"""The node inventory: each node's GPUs as last seen, written to Redis for the RPC verbs.

``ingest.py`` keeps each GPU's last routine sample in memory (``latest``, scalars only) and
marks its node dirty; a node seen for the first time is written at once (it counts for the
circuit breaker), the rest every ``detector_inventory_interval_s``, in chunks.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from services.detector.core import DetectorCore

INVENTORY_CHUNK = 100  # nodes encoded and written per step of an inventory flush


class InventoryMixin(DetectorCore):
    """The periodic (and first-sight) inventory write."""

    async def _inventory_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.detector_inventory_interval_s)
            try:
                await self._flush_inventory()
            except Exception as exc:
                self.log.warning("inventory flush failed: %r", exc)

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
