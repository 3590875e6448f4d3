"""The fleet: clusters and nodes, node drain (planned maintenance) and return (operators)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Body

from services.api.deps import Gw, Operator
from services.api.gateway import ApiProblem, items_of, parse_list
from services.api.models import (
    ClusterView,
    DrainAccepted,
    DrainRequest,
    NodeReturned,
    NodeView,
    Page,
    SpareDepth,
)
from services.api.routes.common import Listing, Lookup, Paging, page_locally
from services.api.routes.params import DEFAULT_LIMIT, ClusterQ, Cursor, Limit, NodeName

router = APIRouter(prefix="/v1", tags=["fleet"])

ClusterViewPage = Page[ClusterView]
NodeViewPage = Page[NodeView]

NODES = Listing(NodeView, "detector", "node_list", Paging.LOCAL)
NODE = Lookup(NodeView, "detector", "node_get", "node", "node")


def merge_clusters(clusters: list[dict[str, Any]], depth: list[SpareDepth]) -> list[ClusterView]:
    """The detector's clusters with the spare pool's counts added (spare-only clusters too)."""
    spares: dict[str, tuple[int, int]] = {}
    for d in depth:
        available, domains = spares.get(d.cluster, (0, 0))
        spares[d.cluster] = (available + d.available, domains + 1)
    out: dict[str, ClusterView] = {}
    for c in clusters:
        view = ClusterView.model_validate(c)
        available, domains = spares.get(view.cluster, (0, 0))
        out[view.cluster] = view.model_copy(
            update={"spares_available": available, "spare_domains": domains}
        )
    for name, (available, domains) in spares.items():
        if name not in out:
            out[name] = ClusterView(cluster=name, spares_available=available, spare_domains=domains)
    return [out[k] for k in sorted(out)]


@router.get(
    "/clusters", response_model=ClusterViewPage, summary="clusters with node and spare counts"
)
async def list_clusters(
    gw: Gw, _: Operator, limit: Limit = DEFAULT_LIMIT, cursor: Cursor = None
) -> ClusterViewPage:
    clusters_raw, depth_raw = await asyncio.gather(
        gw.call("detector", "cluster_list", {}), gw.call("spare_pool", "depth", {})
    )
    clusters, _c = items_of(clusters_raw, "detector", "cluster_list")
    depth_items, _d = items_of(depth_raw, "spare_pool", "depth")
    depth = parse_list(SpareDepth, depth_items, "spare_pool", "depth")
    parse_list(ClusterView, clusters, "detector", "cluster_list")
    merged = merge_clusters(clusters, depth)
    items, nxt = page_locally(merged, limit, cursor)
    return ClusterViewPage(items=items, next_cursor=nxt)


@router.get(
    "/nodes", response_model=NodeViewPage, summary="nodes with health, lemon score and GPUs"
)
async def list_nodes(
    gw: Gw,
    _: Operator,
    cluster: ClusterQ = None,
    limit: Limit = DEFAULT_LIMIT,
    cursor: Cursor = None,
) -> NodeViewPage:
    items, nxt = await NODES.page(gw, limit, cursor, {"cluster": cluster})
    return NodeViewPage(items=items, next_cursor=nxt)


@router.get("/nodes/{node}", response_model=NodeView, summary="one node")
async def get_node(gw: Gw, _: Operator, node: NodeName) -> NodeView:
    return await NODE.get(gw, node)


@router.post(
    "/nodes/{node}/drain",
    status_code=202,
    response_model=DrainAccepted,
    summary="planned maintenance: move every rank off the node at a step boundary",
    responses={404: {"description": "no node of that name is known to the detector"}},
)
async def drain_node(
    gw: Gw, who: Operator, node: NodeName, body: Annotated[DrainRequest | None, Body()] = None
) -> DrainAccepted:
    cluster = body.cluster if body else None
    reason = body.reason if body else "planned maintenance"
    # The scheduler drains whatever name it is given (a node without ranks drains at
    # once): the detector, which knows every node that reported, says whether it exists.
    await gw.call(
        "detector", "node_get", {"node": node, "cluster": cluster}, missing=NODE.missing(node)
    )
    result = await gw.call(
        "scheduler",
        "drain",
        {
            "node": node,
            "cluster": cluster,
            "reason": reason,
            "requested_by": f"operator:{who.token_id}",
        },
        missing=NODE.missing(node),
    )
    if isinstance(result, dict) and isinstance(result.get("cluster"), str):
        cluster = cluster or result["cluster"]
    return DrainAccepted(node=node, cluster=cluster, result=result)


@router.post(
    "/nodes/{node}/return",
    response_model=NodeReturned,
    summary="back to service: detector health reset and spare slots returned",
)
async def return_node(gw: Gw, _: Operator, node: NodeName) -> NodeReturned:
    detector = await gw.call("detector", "node_return", {"node": node}, missing=NODE.missing(node))
    try:
        pool = await gw.call("spare_pool", "return", {"node": node})
    except ApiProblem as exc:
        # A node that holds no spare slots has nothing to return to the pool.
        if exc.status != 404:
            raise
        pool = None
    return NodeReturned(node=node, detector=detector, spare_pool=pool)
