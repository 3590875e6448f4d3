"""The contract's names: subjects, streams, consumers, RPC verbs, exit codes, field types."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Annotated

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
    JOB_RESTARTED = "tr.evt.job.restarted"
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
    INCIDENT_AMENDED = "tr.evt.incident.amended"
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
                Subjects.JOB_RESTARTED,
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
                Subjects.JOB_RESTARTED,
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
                Subjects.JOB_RESTARTED,
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
            filter_subjects=[
                Subjects.INCIDENT_CLOSED,
                Subjects.INCIDENT_OPENED,
                Subjects.INCIDENT_AMENDED,
            ],
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
        # Goodput (docs/design.md §14): one job's, a tenant's in a window.
        "job_goodput",
        "tenant_goodput",
        "incident_list",
        "incident_get",
        "drain",
        # Job-scoped NATS credentials (issue #12): the launcher's role only.
        "job_credentials",
        "job_credentials_revoke",
        # The rendezvous of a job across hosts: one launcher per host joins.
        "join_host",
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
