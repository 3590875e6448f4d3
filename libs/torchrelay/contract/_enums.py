"""The contract's closed vocabularies."""

from __future__ import annotations

from enum import StrEnum

# --------------------------------------------------------------------------- enums


class FaultKind(StrEnum):
    """The fault taxonomy of docs/design.md §5."""

    GPU_LOST = "gpu_lost"
    UNCORRECTABLE_MEMORY = "uncorrectable_memory"
    FIRMWARE_HANG = "firmware_hang"
    MEMORY_UNREPAIRABLE = "memory_unrepairable"
    ROW_REMAP_PENDING = "row_remap_pending"
    NVLINK_FATAL = "nvlink_fatal"
    LINK_DEGRADED = "link_degraded"
    THERMAL_SLOWDOWN = "thermal_slowdown"
    STRAGGLER = "straggler"
    WORKER_LOST = "worker_lost"
    WORKER_HANG = "worker_hang"
    APPLICATION_ERROR = "application_error"
    PLANNED_DRAIN = "planned_drain"


class Severity(StrEnum):
    FATAL = "fatal"
    WARNING = "warning"
    INFO = "info"


class FaultAction(StrEnum):
    """What the detector recommends; the scheduler decides."""

    MIGRATE_NOW = "migrate_now"
    MIGRATE_AT_BOUNDARY = "migrate_at_boundary"
    QUARANTINE = "quarantine"
    RECORD = "record"


class MigrationMode(StrEnum):
    """How the agents switch to a new generation."""

    IMMEDIATE = "immediate"  # abandon the collective in flight
    BOUNDARY = "boundary"  # finish the step in flight, switch after its commit


class Resolution(StrEnum):
    OPEN = "open"
    MIGRATED_LIVE = "migrated_live"
    MIGRATED_PROACTIVE = "migrated_proactive"
    CHECKPOINT_RESTART = "checkpoint_restart"
    SHRUNK = "shrunk"
    MANUAL = "manual"
    LOST = "lost"
    EXCLUDED = "excluded"


class JobPolicy(StrEnum):
    WAIT = "wait"
    SHRINK = "shrink"
    CHECKPOINT_RESTART = "checkpoint_restart"


class NodeHealth(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"
    QUARANTINED = "quarantined"
    LEMON = "lemon"


class SpareState(StrEnum):
    IDLE = "idle"
    HOT = "hot"
    RESERVED = "reserved"
    IN_USE = "in_use"
    QUARANTINED = "quarantined"
    RMA = "rma"


class Role(StrEnum):
    WORKER = "worker"
    SPARE = "spare"


class ReportKind(StrEnum):
    """What an agent (or the launcher on its behalf) reports."""

    JOINED = "joined"  # process is up; carries its rendezvous store address
    COLLECTIVE_FAILED = "collective_failed"
    RESUMED = "resumed"  # running in a new generation; carries stall/lost/bytes
    FENCED = "fenced"  # found itself in an older generation and exited
    FINISHED = "finished"
    APPLICATION_ERROR = "application_error"  # user code raised
    WORKER_EXIT = "worker_exit"  # launcher saw a process exit
    SPARE_READY = "spare_ready"
    # A generation's ranks found no copy of some rank's state (a sharded job that lost a
    # shard and every copy of it): the migration cannot end live, the fallback decides.
    STATE_LOST = "state_lost"
