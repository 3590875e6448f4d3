"""The spare pool: an inventory of spare GPUs that never hands one out twice (docs/design.md §6)."""

from .inventory import Lease, LeaseEnd, SlotView, SpareInventory
from .rules import ReserveRequest, Topology, pick_spare
from .service import SparePool, SparePoolSettings, setup

__all__ = [
    "Lease",
    "LeaseEnd",
    "ReserveRequest",
    "SlotView",
    "SpareInventory",
    "SparePool",
    "SparePoolSettings",
    "Topology",
    "pick_spare",
    "setup",
]
