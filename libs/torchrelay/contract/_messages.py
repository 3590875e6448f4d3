"""Every message on the wire, by the service that publishes it."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from torchrelay.contract._enums import (
    FaultAction,
    FaultKind,
    JobPolicy,
    MigrationMode,
    NodeHealth,
    ReportKind,
    Resolution,
    Role,
    Severity,
    SpareState,
)
from torchrelay.contract._names import (
    SCHEMA_VERSION,
    Name,
    Token,
    UtcDatetime,
    utcnow,
)

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
    # ``launcher``: a host launcher's beat (member_id is the launcher's id, node its host);
    # ``launcher_stopped``: it ended cleanly, so its silence is no host loss.
    kind: Literal["step", "liveness", "launcher", "launcher_stopped"] = "step"
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
    # A job across hosts registers once per host: this host's members, the whole world size.
    nnodes: int = Field(default=1, ge=1, le=100_000)
    node_rank: int | None = Field(default=None, ge=0)
    # Steps between the job's checkpoints (--checkpoint-every); None: it writes none. Goodput's
    # counterfactual restarts from checkpoints at this interval (docs/design.md §14).
    checkpoint_every: int | None = Field(default=None, ge=1)


class HostJoin(Message):
    """A host's launcher joins its job's rendezvous (``tr.rpc.scheduler.join_host``).

    ``node_rank`` None asks the scheduler for the lowest free one. ``instance`` is unique
    per launcher process, so a retried join gets the same answer and a second launcher on
    the same host is refused.
    """

    job_id: Token
    tenant: Token
    node: Name
    nnodes: int = Field(ge=1, le=100_000)
    nproc_per_node: int = Field(ge=1, le=1024)
    node_rank: int | None = Field(default=None, ge=0)
    instance: Token
    claim: str | None = Field(default=None, min_length=16, max_length=256)


class HostJoined(Message):
    """The scheduler's answer to :class:`HostJoin`: this host's place in the job."""

    job_id: Token
    node_rank: int = Field(ge=0)
    nnodes: int = Field(ge=1)
    nproc_per_node: int = Field(ge=1)
    world_size: int = Field(ge=1)
    hosts: dict[str, str] = Field(default_factory=dict)  # node rank (as text) -> node name


class JobFinished(Event):
    job_id: Token
    tenant: Token
    outcome: Literal["succeeded", "failed", "cancelled"]
    exit_code: int = 0
    summary: str = ""
    committed_step: int | None = None


class JobRestarted(Event):
    """The job's launcher restarted its processes from its newest complete checkpoint (the
    ``checkpoint_restart`` fallback, docs/design.md §13): the executor forms the restart's
    generation from ``members``; the scheduler records the steps lost on the incident."""

    job_id: Token
    tenant: Token
    restart: int = Field(ge=1)  # 1 for the job's first restart
    incident_id: str | None = None
    migration_id: str | None = None
    world_size: int = Field(ge=1, le=1_000_000)
    members: list[Member] = Field(min_length=1)
    checkpoint: str | None = None  # the checkpoint's folder; None: none, from step 0
    checkpoint_steps: int = Field(default=0, ge=0)  # the steps it holds
    committed_steps: int | None = Field(default=None, ge=0)  # steps done before the fault
    lost_steps: int | None = Field(default=None, ge=0)  # committed minus checkpoint steps


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
    # The host's seat in a job across hosts (e.g. ``h0``, ``spare-node7``): one credential
    # per seat, all bound to the same claim. None: the one credential of a one-host job.
    seat: Token | None = None
    ttl_s: float = Field(default=30 * 24 * 3600.0, gt=0, le=365 * 24 * 3600.0)


class JobCredentialsRevoke(Message):
    """The launcher ends its job's credential (``job_credentials_revoke``)."""

    job_id: Token
    claim: str = Field(min_length=16, max_length=256)
    seat: Token | None = None


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
    # The slot the failed rank was on and why: a checkpoint restart leaves out a slot
    # whose GPU failed (docs/design.md §13). None from executors before these fields.
    node: Name | None = None
    gpu: int | None = Field(default=None, ge=0)
    fault_kind: FaultKind | None = None


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


class IncidentAmended(Event):
    """What was learnt about a closed incident after it closed: a checkpoint restart's lost
    steps (at ``JobRestarted``) and its stall (at the restarted job's first step). Billing
    appends it to the ledger as an ``amendment`` entry of the incident (docs/design.md §8)."""

    incident: Incident  # the whole incident as now known
    reason: str = Field(default="", max_length=500)


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
    # What a GPU-hour costs the tenant (minor units): goodput's savings are priced at it.
    price_per_gpu_hour_minor: int | None = Field(default=None, ge=0)


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
