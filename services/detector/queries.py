"""Queries: the RPC verbs ``tr.rpc.detector.*``, answered from Redis (any replica answers).

``cluster_list`` -> ``[{cluster, nodes, gpus, unhealthy}]``; ``node_list {cluster?}`` and
``node_get {node, cluster?}`` -> each node's health, lemon score, inventory and GPU faults;
``node_return {node}`` -> the node is healthy again and its open episodes close (a fault that
recurs afterwards is a repeat).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from services.detector.core import SERVICE, DetectorCore
from torchrelay.bus import NotFound
from torchrelay.contract import Name, NodeHealth, NodeHealthChanged, Subjects, make_event_id

INVENTORY_SILENT_S = 30.0


class NodeQuery(BaseModel):
    """Body of ``node_get`` / ``node_return``."""

    model_config = ConfigDict(extra="ignore")
    node: Name
    cluster: Name | None = None


class NodeListQuery(BaseModel):
    """Body of ``node_list``."""

    model_config = ConfigDict(extra="ignore")
    cluster: Name | None = None


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


class QueriesMixin(DetectorCore):
    """``cluster_list``, ``node_list``, ``node_get``, ``node_return``."""

    async def _node_view(
        self, cluster: str, node: str, inv: dict[str, Any] | None, health: NodeHealth, now: float
    ) -> dict[str, Any]:
        gpu_faults = await self.nodes.gpu_health(cluster, node)
        gpus = []
        for g in (inv or {}).get("gpus", []):
            gh = gpu_faults.get(int(g["gpu"]), {})
            gpus.append(
                {**g, "health": gh.get("health", "healthy"), "faults": gh.get("faults", [])}
            )
        last_seen = (inv or {}).get("last_seen")
        return {
            "node": node,
            "cluster": cluster,
            "health": health.value,
            "lemon_score": round(await self.nodes.lemon(cluster, node, now), 4),
            "state": "out_of_service" if self.nodes.out_of_service(health) else "in_service",
            "reporting": last_seen is not None and now - float(last_seen) < INVENTORY_SILENT_S,
            "last_seen": _iso(float(last_seen)) if last_seen else None,
            "backend": (inv or {}).get("backend"),
            "gpus": gpus,
        }

    async def rpc_cluster_list(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """``cluster_list`` -> [{cluster, nodes, gpus, unhealthy}]."""
        del body
        out = []
        for cluster in await self.nodes.clusters():
            inv = await self.nodes.inventory(cluster)
            health = await self.nodes.health_all(cluster)
            out.append(
                {
                    "cluster": cluster,
                    "nodes": len(inv),
                    "gpus": sum(len(v.get("gpus", [])) for v in inv.values()),
                    "unhealthy": sum(1 for h in health.values() if self.nodes.out_of_service(h)),
                }
            )
        return out

    async def rpc_node_list(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """``node_list {cluster?}`` -> every node with health, lemon score and GPUs."""
        q = NodeListQuery.model_validate(body)
        clusters = [q.cluster] if q.cluster else await self.nodes.clusters()
        now = time.time()
        out = []
        for cluster in clusters:
            inv = await self.nodes.inventory(cluster)
            health = await self.nodes.health_all(cluster)
            for node in sorted(set(inv) | set(health)):
                out.append(
                    await self._node_view(
                        cluster, node, inv.get(node), health.get(node, NodeHealth.HEALTHY), now
                    )
                )
        return out

    async def _locate(self, q: NodeQuery) -> str:
        cluster = q.cluster or await self.nodes.find_cluster(q.node)
        if cluster is None or not await self.ctx.redis.hexists(
            self.nodes.nodes_key(cluster), q.node
        ):
            raise NotFound(
                f"node {q.node} is unknown to the detector (no telemetry from it"
                f"{' in cluster ' + q.cluster if q.cluster else ''})",
                "node",
            )
        return cluster

    async def rpc_node_get(self, body: dict[str, Any]) -> dict[str, Any]:
        """``node_get {node, cluster?}`` -> one node."""
        q = NodeQuery.model_validate(body)
        cluster = await self._locate(q)
        inv = (await self.nodes.inventory(cluster)).get(q.node)
        return await self._node_view(
            cluster, q.node, inv, await self.nodes.health(cluster, q.node), time.time()
        )

    async def rpc_node_return(self, body: dict[str, Any]) -> dict[str, Any]:
        """``node_return {node}``: back to healthy after quarantine, reset or drain.

        Open episodes of the node close, so a fault that recurs afterwards is a repeat
        (escalated to quarantine for hardware inspection).
        """
        q = NodeQuery.model_validate(body)
        cluster = await self._locate(q)
        previous = await self.nodes.health(cluster, q.node)
        closed = await self.episodes.close_node(self.nodes.episodes_key(cluster, q.node))
        await self.nodes.set_health(cluster, q.node, NodeHealth.HEALTHY)
        await self.nodes.clear_gpus(cluster, q.node)
        now = time.time()
        await self.bus.publish(
            NodeHealthChanged(
                event_id=make_event_id("return", cluster, q.node, int(now * 1000)),
                source=SERVICE,
                cluster=cluster,
                node=q.node,
                health=NodeHealth.HEALTHY,
                lemon_score=await self.nodes.lemon(cluster, q.node, now),
                reason=f"returned to service by operator (was {previous.value})",
            ),
            Subjects.NODE_HEALTH,
        )
        view = await self._node_view(
            cluster,
            q.node,
            (await self.nodes.inventory(cluster)).get(q.node),
            NodeHealth.HEALTHY,
            now,
        )
        return {**view, "previous_health": previous.value, "episodes_closed": closed}
