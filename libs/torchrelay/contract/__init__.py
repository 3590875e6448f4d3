"""The wire contract: every subject, stream, consumer, KV bucket and message of torchrelay.

This module is the single source of truth that ``proto/`` is generated from. Services meet
only on the names declared here. Readers accept unknown fields (forward compatibility) and
reject invalid ones with a validation error naming the field.

``_names`` holds the subjects, streams, consumers and field types, ``_enums`` the closed
vocabularies, ``_messages`` the message models; every name is importable from here.
"""

from __future__ import annotations

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
from torchrelay.contract._messages import (
    AgentReport,
    Contract,
    CreditIssued,
    DeadLetter,
    DrainRequested,
    Event,
    FaultDetected,
    FenceOrder,
    Generation,
    GenerationChanged,
    Guarantee,
    Heartbeat,
    HostJoin,
    HostJoined,
    Incident,
    IncidentAmended,
    IncidentClosed,
    IncidentOpened,
    JobCredentials,
    JobCredentialsRequest,
    JobCredentialsRevoke,
    JobFinished,
    JobRegistered,
    JobRestarted,
    Member,
    Message,
    MigrationCompleted,
    MigrationFailed,
    MigrationRequested,
    MigrationStarted,
    NodeHealthChanged,
    RankAssignment,
    RpcError,
    RpcReply,
    SparePoolLow,
    SpareQuarantined,
    SpareReleased,
    SpareReserved,
    SpareSlot,
    TelemetryBatch,
    TelemetrySample,
)
from torchrelay.contract._names import (
    CONSUMERS,
    DLQ_STREAM,
    EVENTS_STREAM,
    EXIT_APPLICATION_ERROR,
    EXIT_FENCED,
    EXIT_OK,
    GENERATIONS_BUCKET,
    RPC_VERBS,
    SCHEMA_VERSION,
    SERVICES,
    STREAMS,
    ConsumerSpec,
    Name,
    StreamSpec,
    Subjects,
    Token,
    UtcDatetime,
    make_event_id,
    utcnow,
)

# Every message model, by name: what ``proto/`` is generated from.
EVENT_SUBJECTS: dict[type[Message], str] = {
    FaultDetected: Subjects.FAULT_DETECTED,
    NodeHealthChanged: Subjects.NODE_HEALTH,
    DrainRequested: Subjects.DRAIN_REQUESTED,
    JobRegistered: Subjects.JOB_REGISTERED,
    JobFinished: Subjects.JOB_FINISHED,
    JobRestarted: Subjects.JOB_RESTARTED,
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
    IncidentAmended: Subjects.INCIDENT_AMENDED,
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
    HostJoin,
    HostJoined,
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


__all__ = [
    "CONSUMERS",
    "DLQ_STREAM",
    "EVENTS_STREAM",
    "EVENT_SUBJECTS",
    "EXIT_APPLICATION_ERROR",
    "EXIT_FENCED",
    "EXIT_OK",
    "GENERATIONS_BUCKET",
    "MODELS",
    "RPC_VERBS",
    "SCHEMA_VERSION",
    "SERVICES",
    "STREAMS",
    "AgentReport",
    "ConsumerSpec",
    "Contract",
    "CreditIssued",
    "DeadLetter",
    "DrainRequested",
    "Event",
    "FaultAction",
    "FaultDetected",
    "FaultKind",
    "FenceOrder",
    "Generation",
    "GenerationChanged",
    "Guarantee",
    "Heartbeat",
    "HostJoin",
    "HostJoined",
    "Incident",
    "IncidentAmended",
    "IncidentClosed",
    "IncidentOpened",
    "JobCredentials",
    "JobCredentialsRequest",
    "JobCredentialsRevoke",
    "JobFinished",
    "JobPolicy",
    "JobRegistered",
    "JobRestarted",
    "Member",
    "Message",
    "MigrationCompleted",
    "MigrationFailed",
    "MigrationMode",
    "MigrationRequested",
    "MigrationStarted",
    "Name",
    "NodeHealth",
    "NodeHealthChanged",
    "RankAssignment",
    "ReportKind",
    "Resolution",
    "Role",
    "RpcError",
    "RpcReply",
    "Severity",
    "SparePoolLow",
    "SpareQuarantined",
    "SpareReleased",
    "SpareReserved",
    "SpareSlot",
    "SpareState",
    "StreamSpec",
    "Subjects",
    "TelemetryBatch",
    "TelemetrySample",
    "Token",
    "UtcDatetime",
    "make_event_id",
    "model_for_subject",
    "utcnow",
]
