"""The spare pool: spare slots and their depth per NVLink domain (operators only)."""

from __future__ import annotations

from fastapi import APIRouter

from services.api.deps import Gw, Operator
from services.api.gateway import parse
from services.api.models import Page, SpareDepth, SpareRegistration, SpareSlot
from services.api.routes.common import Listing, Lookup, Paging
from services.api.routes.params import (
    DEFAULT_LIMIT,
    ClusterQ,
    Cursor,
    Limit,
    ObjectId,
    SpareCursor,
)
from torchrelay.contract import SpareState

router = APIRouter(prefix="/v1", tags=["spares"])

SpareSlotPage = Page[SpareSlot]
SpareDepthPage = Page[SpareDepth]

SLOTS = Listing(SpareSlot, "spare_pool", "list", Paging.SERVICE_OR_LOCAL)
DEPTH = Listing(SpareDepth, "spare_pool", "depth", Paging.LOCAL)
SLOT = Lookup(SpareSlot, "spare_pool", "get", "spare slot", "slot_id")


@router.get("/spares", response_model=SpareSlotPage, summary="spare inventory")
async def list_spares(
    gw: Gw,
    _: Operator,
    cluster: ClusterQ = None,
    state: SpareState | None = None,
    limit: Limit = DEFAULT_LIMIT,
    cursor: SpareCursor = None,
) -> SpareSlotPage:
    query = {"cluster": cluster, "state": state.value if state else None}
    items, nxt = await SLOTS.page(gw, limit, cursor, query)
    return SpareSlotPage(items=items, next_cursor=nxt)


@router.post("/spares", status_code=201, response_model=SpareSlot, summary="register a spare slot")
async def register_spare(gw: Gw, _: Operator, body: SpareRegistration) -> SpareSlot:
    result = await gw.call("spare_pool", "register", body.to_slot())
    # The pool answers {slot, previous_state}; a bare slot is accepted too.
    slot = result.get("slot", result) if isinstance(result, dict) else result
    return parse(SpareSlot, slot, "spare_pool", "register")


@router.get(
    "/spares/depth",
    response_model=SpareDepthPage,
    summary="spares available per NVLink domain, against its floor",
)
async def spare_depth(
    gw: Gw,
    _: Operator,
    cluster: ClusterQ = None,
    limit: Limit = DEFAULT_LIMIT,
    cursor: Cursor = None,
) -> SpareDepthPage:
    items, nxt = await DEPTH.page(gw, limit, cursor, {"cluster": cluster})
    return SpareDepthPage(items=items, next_cursor=nxt)


@router.get("/spares/{slot_id}", response_model=SpareSlot, summary="one spare slot")
async def get_spare(gw: Gw, _: Operator, slot_id: ObjectId) -> SpareSlot:
    return await SLOT.get(gw, slot_id)
