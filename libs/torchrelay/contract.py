"""The wire contract: every subject, stream, consumer, KV bucket and message of torchrelay.

This module is the single source of truth that ``proto/`` is generated from. Services meet
only on the names declared here. Readers accept unknown fields (forward compatibility) and
reject invalid ones with a validation error naming the field.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1


def utcnow() -> datetime:
    """The current time, timezone-aware in UTC."""
    return datetime.now(UTC)


def _to_utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("timestamp must carry a timezone (UTC)")
    return value.astimezone(UTC)


UtcDatetime = Annotated[datetime, AfterValidator(_to_utc)]
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-.:]+$")]
# A NATS subject token: no dots, spaces or wildcards.
Token = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-]+$")]


def make_event_id(*parts: object) -> str:
    """A deterministic event id from the parts that make an event unique.

    The same logical event built twice (a retry, a redelivery) gets the same id, so
    JetStream's ``Nats-Msg-Id`` dedupe and the consumers' dedupe both recognise it.
    """
    raw = "\x1f".join(str(p) for p in parts).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


# --------------------------------------------------------------------------- subjects


class Subjects:
    """Subject names. Functions build the per-entity subjects."""

    EVENTS_ALL = "tr.evt.>"
    FAULT_DETECTED = "tr.evt.fault.detected"
    NODE_HEALTH = "tr.evt.node.health"
    JOB_REGISTERED = "tr.evt.job.registered"
    JOB_FINISHED = "tr.evt.job.finished"
    GENERATION_CHANGED = "tr.evt.job.generation"
    DRAIN_REQUESTED = "tr.evt.node.drain"
    MIGRATION_REQUESTED = "tr.evt.migration.requested"
    MIGRATION_STARTED = "tr.evt.migration.started"
    MIGRATION_COMPLETED = "tr.evt.migration.completed"
    MIGRATION_FAILED = "tr.evt.migration.failed"
    SPARE_RESERVED = "tr.evt.spare.reserved"
    SPARE_RELEASED = "tr.evt.spare.released"
    SPARE_QUARANTINED = "tr.evt.spare.quarantined"
    SPARE_POOL_LOW = "tr.evt.spare.pool_low"
    INCIDENT_OPENED = "tr.evt.incident.opened"
    INCIDENT_CLOSED = "tr.evt.incident.closed"
    CREDIT_ISSUED = "tr.evt.credit.issued"
    AGENT_REPORTS_ALL = "tr.evt.report.>"
    TELEMETRY_ALL = "tr.tel.>"
    TELEMETRY_CRITICAL_ALL = "tr.crit.>"
    HEARTBEATS_ALL = "tr.hb.>"
    DLQ_ALL = "tr.dlq.>"
    FENCE_ALL = "tr.ctl.fence.>"

    @staticmethod
    def agent_report(job_id: str) -> str:
        """Durable reports of one job's agents and launcher."""
        return f"tr.evt.report.{job_id}"

    @staticmethod
    def telemetry(cluster: str, node: str) -> str:
        """Core-NATS telemetry batches of one node."""
        return f"tr.tel.{cluster}.{node}"

    @staticmethod
    def telemetry_critical(cluster: str, node: str) -> str:
        """Core-NATS critical telemetry (XIDs, lost GPUs) of one node, a ``TelemetryBatch``
        with ``critical=True``; apart from the routine batches so it never queues behind them."""
        return f"tr.crit.{cluster}.{node}"

    @staticmethod
    def heartbeat(job_id: str) -> str:
        """Core-NATS heartbeats of one job's ranks."""
        return f"tr.hb.{job_id}"

    @staticmethod
    def dlq(service: str) -> str:
        """Dead letters of one service."""
        return f"tr.dlq.{service}"

    @staticmethod
    def rpc(service: str, verb: str) -> str:
        """Request/reply subject of a service's verb."""
        return f"tr.rpc.{service}.{verb}"

    @staticmethod
    def fence(job_id: str) -> str:
        """Fencing orders to the launcher of one job (request/reply)."""
        return f"tr.ctl.fence.{job_id}"

    @staticmethod
    def launcher(job_id: str, verb: str) -> str:
        """Commands to one job's launcher (request/reply), e.g. ``spawn_spare``."""
        return f"tr.ctl.launcher.{job_id}.{verb}"

    @staticmethod
    def chaos(cluster: str, node: str) -> str:
        """Live fault injection into a node agent's simulator backend (request/reply)."""
        return f"tr.ctl.chaos.{cluster}.{node}"


# --------------------------------------------------------------------------- streams, KV


class StreamSpec(BaseModel):
    """A JetStream stream declaration."""

    model_config = ConfigDict(frozen=True)
    name: str
    subjects: list[str]
    duplicate_window_s: float
    max_age_s: float | None = None


EVENTS_STREAM = StreamSpec(
    name="TR_EVENTS",
    subjects=[Subjects.EVENTS_ALL],
    # Longer than any publisher's retry budget (bus.publish retries for at most 30 s).
    duplicate_window_s=300.0,
)
DLQ_STREAM = StreamSpec(
    name="TR_DLQ",
    subjects=[Subjects.DLQ_ALL],
    duplicate_window_s=120.0,
    max_age_s=14 * 24 * 3600.0,
)
STREAMS = (EVENTS_STREAM, DLQ_STREAM)

GENERATIONS_BUCKET = "tr_generations"


class ConsumerSpec(BaseModel):
    """A durable pull consumer of the events stream, provisioned explicitly."""

    model_config = ConfigDict(frozen=True)
    service: str
    durable: str
    filter_subjects: list[str]
    stream: str = EVENTS_STREAM.name
    ack_wait_s: float = 30.0
    max_deliver: int = 8
    # Redelivery schedule for messages that were not acked (crash) or were nak'd.
    backoff_s: list[float] = [1.0, 2.0, 5.0, 10.0, 30.0]
    max_ack_pending: int = 1000


CONSUMERS: dict[str, ConsumerSpec] = {
    spec.durable: spec
    for spec in (
        ConsumerSpec(
            service="detector",
            durable="detector-reports",
            filter_subjects=[
                Subjects.AGENT_REPORTS_ALL,
                Subjects.JOB_REGISTERED,
                Subjects.JOB_FINISHED,
                Subjects.GENERATION_CHANGED,
            ],
        ),
        ConsumerSpec(
            service="scheduler",
            durable="scheduler",
            filter_subjects=[
                Subjects.FAULT_DETECTED,
                Subjects.JOB_REGISTERED,
                Subjects.JOB_FINISHED,
                Subjects.DRAIN_REQUESTED,
                Subjects.MIGRATION_COMPLETED,
                Subjects.MIGRATION_FAILED,
                Subjects.GENERATION_CHANGED,
            ],
        ),
        ConsumerSpec(
            service="spare_pool",
            durable="spare-pool",
            filter_subjects=[Subjects.NODE_HEALTH, Subjects.JOB_FINISHED],
        ),
        ConsumerSpec(
            service="migration_executor",
            durable="migration-executor",
            filter_subjects=[
                Subjects.MIGRATION_REQUESTED,
                Subjects.JOB_REGISTERED,
                Subjects.JOB_FINISHED,
            ],
        ),
        # The agents' reports on a consumer of their own: a consumer delivers one message at
        # a time, and a MigrationRequested must not wait behind the reports of every rank of
        # every job (a 64-rank job's survivors all report the failed collective at once).
        ConsumerSpec(
            service="migration_executor",
            durable="migration-executor-reports",
            filter_subjects=[Subjects.AGENT_REPORTS_ALL],
        ),
        ConsumerSpec(
            service="billing",
            durable="billing",
            filter_subjects=[Subjects.INCIDENT_CLOSED, Subjects.INCIDENT_OPENED],
        ),
    )
}

# Request/reply verbs each service answers on ``tr.rpc.<service>.<verb>``.
RPC_VERBS: dict[str, tuple[str, ...]] = {
    "detector": ("cluster_list", "node_list", "node_get", "node_return"),
    "scheduler": (
        "job_list",
        "job_get",
        "job_timeline",
        "incident_list",
        "incident_get",
        "drain",
        # Job-scoped NATS credentials (issue #12): the launcher's role only.
        "job_credentials",
        "job_credentials_revoke",
    ),
    "spare_pool": (
        "register",
        "reserve",
        "confirm",
        "release",
        "list",
        "get",
        "quarantine",
        "return",
        "depth",
    ),
    "migration_executor": ("saga_list", "saga_get"),
    "billing": (
        "contract_create",
        "contract_get",
        "contract_list",
        "guarantee",
        "close_term",
        "credits_list",
        "export",
        "ledger_verify",
        "ledger_correct",
    ),
}

# Exit codes of a training process, read by the launcher.
EXIT_OK = 0
EXIT_APPLICATION_ERROR = 1  # user code raised; the agent also writes an exit record
EXIT_FENCED = 75  # found itself in an older generation: another process holds its rank

SERVICES = ("detector", "scheduler", "spare_pool", "migration_executor", "billing", "api")


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


# --------------------------------------------------------------------------- envelope


class Message(BaseModel):
    """Base of everything on the wire: unknown fields are ignored, invalid ones rejected."""

    model_config = ConfigDict(extra="ignore", frozen=True, use_enum_values=False)
    subject_hint: ClassVar[str] = ""


class Event(Message):
    """Common envelope of every durable event and stream message."""

    event_id: str = Field(min_length=1, max_length=128)
    schema_version: int = SCHEMA_VERSION
    occurred_at: UtcDatetime = Field(default_factory=utcnow)
    source: str = Field(min_length=1, max_length=128)


# --------------------------------------------------------------------------- telemetry


class TelemetrySample(Message):
    """One reading of one GPU. Absent fields were not supported or not read."""

    cluster: Name
    node: Name
    gpu: int = Field(ge=0, le=1023)
    ts: UtcDatetime = Field(default_factory=utcnow)
    backend: Literal["nvml", "amdsmi", "sim"] = "sim"
    gpu_model: str | None = None
    temperature_c: float | None = None
    temp_slowdown_c: float | None = None
    temp_shutdown_c: float | None = None
    memory_temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    ecc_volatile_corrected: int | None = Field(default=None, ge=0)
    ecc_volatile_uncorrected: int | None = Field(default=None, ge=0)
    ecc_aggregate_corrected: int | None = Field(default=None, ge=0)
    ecc_aggregate_uncorrected: int | None = Field(default=None, ge=0)
    retired_pages: int | None = Field(default=None, ge=0)
    remapped_rows_correctable: int | None = Field(default=None, ge=0)
    remapped_rows_uncorrectable: int | None = Field(default=None, ge=0)
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    unrepairable_memory: bool | None = None
    clock_event_reasons: int | None = Field(default=None, ge=0)
    hw_slowdown: bool | None = None
    hw_thermal_slowdown: bool | None = None
    sw_thermal_slowdown: bool | None = None
    nvlink_crc_errors: int | None = Field(default=None, ge=0)
    nvlink_replay_errors: int | None = Field(default=None, ge=0)
    nvlink_recovery_errors: int | None = Field(default=None, ge=0)
    nvlink_down_links: int | None = Field(default=None, ge=0)
    pcie_replay_count: int | None = Field(default=None, ge=0)
    recovery_action: int | None = None
    gpu_lost: bool | None = None
    reset_required: bool | None = None
    xid: int | None = None
    extra: dict[str, float] = Field(default_factory=dict)


class TelemetryBatch(Event):
    """A node agent's batch of samples on ``tr.tel.<cluster>.<node>`` (core NATS)."""

    cluster: Name
    node: Name
    samples: list[TelemetrySample] = Field(max_length=4096)
    critical: bool = False  # sent by the event thread (XID), not the poll loop


class Heartbeat(Event):
    """An agent's beat on ``tr.hb.<job>``: per committed step, and a liveness beat."""

    job_id: Token
    member_id: Token
    rank: int | None = Field(default=None, ge=0)
    generation: int = Field(ge=0)
    step: int = Field(ge=-1)  # committed step; -1 before the first commit
    step_time_s: float | None = Field(default=None, ge=0)
    kind: Literal["step", "liveness"] = "step"
    node: Name
    gpu: int = Field(ge=0)
    pid: int = Field(ge=0)
    cluster: Name = "local"


class AgentReport(Event):
    """A durable report from a job's agent or launcher on ``tr.evt.report.<job>``."""

    job_id: Token
    member_id: Token
    kind: ReportKind
    role: Role = Role.WORKER
    rank: int | None = Field(default=None, ge=0)
    generation: int = Field(default=0, ge=0)
    step: int | None = None
    peer_rank: int | None = None
    error: str | None = Field(default=None, max_length=8192)
    exit_code: int | None = None
    stall_ms: float | None = Field(default=None, ge=0)
    lost_steps: int | None = Field(default=None, ge=0)
    bytes_received: int | None = Field(default=None, ge=0)
    store_addr: str | None = None
    node: Name = "local-0"
    gpu: int = Field(default=0, ge=0)
    pid: int | None = None
    cluster: Name = "local"


# --------------------------------------------------------------------------- detector


class FaultDetected(Event):
    """One fault episode on a GPU, node or rank (one per episode, not per sample)."""

    fault_id: str
    cluster: Name
    node: Name
    gpu: int | None = None
    job_id: Token | None = None
    rank: int | None = None
    member_id: Token | None = None
    kind: FaultKind
    severity: Severity
    action: FaultAction
    evidence: dict[str, Any] = Field(default_factory=dict)
    repeat: int = Field(default=1, ge=1)
    first_seen_at: UtcDatetime = Field(default_factory=utcnow)


class NodeHealthChanged(Event):
    cluster: Name
    node: Name
    health: NodeHealth
    lemon_score: float = 0.0
    gpu: int | None = None
    reason: str = ""


class DrainRequested(Event):
    """Planned maintenance: move every rank off a node at step boundaries."""

    cluster: Name
    node: Name
    requested_by: str = "operator"
    reason: str = "planned maintenance"


# --------------------------------------------------------------------------- jobs


class Member(Message):
    """One process of a job: a worker or a hot spare, in a slot (node, gpu)."""

    member_id: Token
    role: Role
    node: Name
    gpu: int = Field(ge=0)
    pid: int | None = None


class JobRegistered(Event):
    job_id: Token
    tenant: Token
    cluster: Name = "local"
    world_size: int = Field(ge=1, le=1_000_000)
    spares: int = Field(ge=0)
    policy: JobPolicy = JobPolicy.WAIT
    wait_timeout_s: float = Field(default=60.0, gt=0)
    allow_shrink: bool = False
    launcher_id: Token
    members: list[Member] = Field(default_factory=list)


class JobFinished(Event):
    job_id: Token
    tenant: Token
    outcome: Literal["succeeded", "failed", "cancelled"]
    exit_code: int = 0
    summary: str = ""
    committed_step: int | None = None


class RankAssignment(Message):
    rank: int = Field(ge=0)
    member_id: Token
    node: Name
    gpu: int = Field(ge=0)


class Generation(Message):
    """The value of a job's key in the generations KV bucket: who holds which rank.

    Written only by the migration executor, with compare-and-set on the KV revision.
    Generations are the fencing token: a process not named in the newest one exits.
    """

    job_id: Token
    generation: int = Field(ge=1)
    world_size: int = Field(ge=1)
    ranks: list[RankAssignment]
    store_member: Token  # the live member hosting the rendezvous store
    store_addr: str  # host:port of that member's store
    mode: MigrationMode = MigrationMode.IMMEDIATE
    departing: list[Token] = Field(default_factory=list)
    reason: str = "formed"
    migration_id: str | None = None
    written_at: UtcDatetime = Field(default_factory=utcnow)

    def member_rank(self, member_id: str) -> int | None:
        """The rank ``member_id`` holds in this generation, or None."""
        for a in self.ranks:
            if a.member_id == member_id:
                return a.rank
        return None


class GenerationChanged(Event):
    job_id: Token
    generation: int = Field(ge=1)
    previous: int = Field(ge=0)
    ranks: list[RankAssignment]
    reason: str
    migration_id: str | None = None


class FenceOrder(Message):
    """Ask a job's launcher to kill a member that no longer holds a rank."""

    job_id: Token
    member_id: Token
    generation: int
    reason: str


class JobCredentialsRequest(Message):
    """The launcher asks the scheduler (``job_credentials``) for a job-scoped NATS user."""

    job_id: Token
    tenant: Token
    # A secret of the launcher's own: the job is bound to it, so only the same launcher may
    # mint or revoke the job's credential (the scheduler keeps it hashed).
    claim: str = Field(min_length=16, max_length=256)
    ttl_s: float = Field(default=30 * 24 * 3600.0, gt=0, le=365 * 24 * 3600.0)


class JobCredentialsRevoke(Message):
    """The launcher ends its job's credential (``job_credentials_revoke``)."""

    job_id: Token
    claim: str = Field(min_length=16, max_length=256)


class JobCredentials(Message):
    """A job-scoped NATS user: publish the job's heartbeats/reports, read its generation."""

    job_id: Token
    user: str
    password: str
    expires_at: UtcDatetime


# --------------------------------------------------------------------------- migration


class MigrationRequested(Event):
    migration_id: str
    incident_id: str
    job_id: Token
    tenant: Token
    rank: int = Field(ge=0)
    member_id: Token
    node: Name
    gpu: int = Field(ge=0)
    mode: MigrationMode
    fault_kind: FaultKind
    generation_before: int = Field(ge=1)


class MigrationStarted(Event):
    migration_id: str
    incident_id: str
    job_id: Token
    rank: int
    lease_id: str
    spare_slot_id: str
    generation_before: int
    generation_after: int


class MigrationCompleted(Event):
    migration_id: str
    incident_id: str
    job_id: Token
    rank: int
    mode: MigrationMode
    to_node: Name
    to_gpu: int
    generation_before: int
    generation_after: int
    stall_ms: float = Field(ge=0)
    lost_steps: int = Field(ge=0)
    bytes_moved: int = Field(ge=0)


class MigrationFailed(Event):
    migration_id: str
    incident_id: str
    job_id: Token
    reason: str
    fallback: Resolution


# --------------------------------------------------------------------------- spares


class SpareSlot(Message):
    """One spare GPU slot of the inventory."""

    slot_id: str
    cluster: Name = "local"
    node: Name
    gpu: int = Field(ge=0)
    gpu_model: str = "cpu-sim"
    memory_mb: int = Field(default=0, ge=0)
    nvlink_domain: str = "default"
    rack: str = "default"
    zone: str = "default"
    state: SpareState = SpareState.IDLE
    job_id: Token | None = None
    member_id: Token | None = None


class SpareReserved(Event):
    lease_id: str
    slot: SpareSlot
    job_id: Token
    expires_at: UtcDatetime


class SpareReleased(Event):
    lease_id: str
    slot_id: str
    reason: str


class SpareQuarantined(Event):
    slot_id: str | None = None
    cluster: Name = "local"
    node: Name
    gpu: int | None = None
    state: Literal["quarantined", "rma"] = "quarantined"
    reason: str


class SparePoolLow(Event):
    cluster: Name
    nvlink_domain: str
    available: int
    floor: int


# --------------------------------------------------------------------------- incidents


class Incident(Message):
    """One failure as it affected one job (field names from docs/interfaces.md)."""

    incident_id: str
    tenant: Token
    job_id: Token
    rank: int | None = None
    node: Name
    gpu: int | None = None
    fault_kind: FaultKind
    severity: Severity
    detected_at: UtcDatetime
    resolved_at: UtcDatetime | None = None
    resolution: Resolution = Resolution.OPEN
    stall_ms: float | None = None
    lost_steps: int | None = None
    bytes_moved: int | None = None
    generation_before: int | None = None
    generation_after: int | None = None
    cluster: Name = "local"
    fault_id: str | None = None


class IncidentOpened(Event):
    incident: Incident


class IncidentClosed(Event):
    incident: Incident


# --------------------------------------------------------------------------- billing


class Contract(Message):
    """A tenant's guarantee contract (money in integer minor units)."""

    contract_id: str
    tenant: Token
    term_start: UtcDatetime
    term_end: UtcDatetime
    renewal_fee_minor: int = Field(ge=0)
    currency: str = Field(pattern=r"^[A-Z]{3}$")
    threshold: float = Field(default=0.9, gt=0, le=1)
    credit_rate: float = Field(default=0.25, ge=0, le=1)
    count_proactive: bool = False


class Guarantee(Message):
    contract_id: str
    term_start: UtcDatetime
    term_end: UtcDatetime
    eligible_failures: int
    resolved_by_migration: int
    prevented_failures: int
    ratio: float
    threshold: float
    met: bool
    credit_minor: int
    currency: str
    final: bool


class CreditIssued(Event):
    credit_id: str
    contract_id: str
    tenant: Token
    term_start: UtcDatetime
    term_end: UtcDatetime
    amount_minor: int = Field(ge=0)
    currency: str
    eligible_failures: int
    resolved_by_migration: int
    ratio: float


# --------------------------------------------------------------------------- rpc


class RpcError(Message):
    code: Literal["invalid", "not_found", "conflict", "unavailable", "internal", "forbidden"]
    message: str
    field: str | None = None


class RpcReply(Message):
    """The reply envelope of every ``tr.rpc.<service>.<verb>``."""

    ok: bool
    result: Any = None
    error: RpcError | None = None


class DeadLetter(Message):
    """What lands on ``tr.dlq.<service>``: the original bytes and why they were refused."""

    service: str
    subject: str
    reason: str
    payload: str  # original payload, decoded with errors replaced, truncated
    headers: dict[str, str] = Field(default_factory=dict)
    received_at: UtcDatetime = Field(default_factory=utcnow)


# Every message model, by name: what ``proto/`` is generated from.
EVENT_SUBJECTS: dict[type[Message], str] = {
    FaultDetected: Subjects.FAULT_DETECTED,
    NodeHealthChanged: Subjects.NODE_HEALTH,
    DrainRequested: Subjects.DRAIN_REQUESTED,
    JobRegistered: Subjects.JOB_REGISTERED,
    JobFinished: Subjects.JOB_FINISHED,
    GenerationChanged: Subjects.GENERATION_CHANGED,
    MigrationRequested: Subjects.MIGRATION_REQUESTED,
    MigrationStarted: Subjects.MIGRATION_STARTED,
    MigrationCompleted: Subjects.MIGRATION_COMPLETED,
    MigrationFailed: Subjects.MIGRATION_FAILED,
    SpareReserved: Subjects.SPARE_RESERVED,
    SpareReleased: Subjects.SPARE_RELEASED,
    SpareQuarantined: Subjects.SPARE_QUARANTINED,
    SparePoolLow: Subjects.SPARE_POOL_LOW,
    IncidentOpened: Subjects.INCIDENT_OPENED,
    IncidentClosed: Subjects.INCIDENT_CLOSED,
    CreditIssued: Subjects.CREDIT_ISSUED,
    AgentReport: "tr.evt.report.{job_id}",
    TelemetryBatch: "tr.tel.{cluster}.{node}",
    Heartbeat: "tr.hb.{job_id}",
    DeadLetter: "tr.dlq.{service}",
    FenceOrder: "tr.ctl.fence.{job_id}",
}

_OTHER_MODELS: tuple[type[Message], ...] = (
    TelemetrySample,
    Member,
    RankAssignment,
    Generation,
    SpareSlot,
    Incident,
    Contract,
    Guarantee,
    RpcError,
    RpcReply,
)
MODELS: dict[str, type[Message]] = {m.__name__: m for m in (*EVENT_SUBJECTS, *_OTHER_MODELS)}

# Messages read from the events stream, by subject (prefix match for per-entity subjects).
_STREAM_MODELS: dict[str, type[Event]] = {
    subj: model  # type: ignore[misc]
    for model, subj in EVENT_SUBJECTS.items()
    if subj.startswith("tr.evt.") and "{" not in subj
}


def model_for_subject(subject: str) -> type[Event] | None:
    """The event model carried on a stream subject, or None if the subject is unknown."""
    if subject in _STREAM_MODELS:
        return _STREAM_MODELS[subject]
    if subject.startswith("tr.evt.report."):
        return AgentReport
    if subject.startswith(("tr.tel.", "tr.crit.")):
        return TelemetryBatch
    if subject.startswith("tr.hb."):
        return Heartbeat
    return None
