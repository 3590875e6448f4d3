"""The roles and what each may publish and subscribe to; the job-scoped users' names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchrelay.auth._keys import (
    AuthError,
)
from torchrelay.contract import CONSUMERS, GENERATIONS_BUCKET, STREAMS, Subjects

CALLOUT_SUBJECT = "$SYS.REQ.USER.AUTH"
JOB_USER_PREFIX = "job."
# Inbox prefix of a job's connections: they may subscribe to replies under it only.
JOB_INBOX_PREFIX = "_INBOX_"
# Inbox prefix of the static roles (``_RINBOX.<role>``): disjoint from every job's.
ROLE_INBOX_PREFIX = "_RINBOX"
GENERATIONS_STREAM = f"KV_{GENERATIONS_BUCKET}"
KV_PREFIX = f"$KV.{GENERATIONS_BUCKET}"

SERVICE_ROLES = ("detector", "scheduler", "spare_pool", "migration_executor", "billing", "api")
ROLES = (*SERVICE_ROLES, "node_agent", "launcher", "operator")
# Break-glass superuser (every subject): recovery by hand, and the chaos tests that replay
# or forge events on purpose. No process of the stack uses it.
ADMIN = "admin"
USERS = (*ROLES, ADMIN)
# The scheduler's user in the system account: it may only list connections and close them
# (a revoked job's live connections end at once).
REVOKER = "revoker"
SYSTEM_ACCOUNT = "SYS"
DEFAULT_JOB_TTL_S = 30 * 24 * 3600.0


# --------------------------------------------------------------------------- permissions


@dataclass(frozen=True)
class Permissions:
    """Publish/subscribe allow and deny lists of one NATS user."""

    pub_allow: tuple[str, ...]
    sub_allow: tuple[str, ...]
    pub_deny: tuple[str, ...] = ()
    sub_deny: tuple[str, ...] = ()
    responses: bool = False

    def as_config(self) -> dict[str, Any]:
        """The ``permissions`` object of the server configuration."""
        out: dict[str, Any] = {
            "publish": {"allow": list(self.pub_allow)},
            "subscribe": {"allow": list(self.sub_allow)},
        }
        if self.pub_deny:
            out["publish"]["deny"] = list(self.pub_deny)
        if self.sub_deny:
            out["subscribe"]["deny"] = list(self.sub_deny)
        if self.responses:
            out["allow_responses"] = True
        return out

    def as_jwt(self) -> dict[str, Any]:
        """The permission claims of a user JWT."""
        out: dict[str, Any] = {
            "pub": {"allow": list(self.pub_allow)},
            "sub": {"allow": list(self.sub_allow)},
        }
        if self.pub_deny:
            out["pub"]["deny"] = list(self.pub_deny)
        if self.sub_deny:
            out["sub"]["deny"] = list(self.sub_deny)
        if self.responses:
            out["resp"] = {"max": 1, "ttl": 0}
        return out


# JetStream's administration API (stream/consumer create, update, delete, purge, message
# get/delete) is the provisioning identity's alone: a stream or consumer made by anyone else
# could RePublish, mirror, source or push-deliver into a protected subject, and the server
# does not check the creator's publish permissions on those internal deliveries. Each runtime
# role gets exactly the API subjects its own work needs.
_API = "$JS.API"
# Reading the generations bucket: bind (stream info) and direct gets of a key's last value.
_GENERATION_READS = (
    f"{_API}.STREAM.INFO.{GENERATIONS_STREAM}",
    f"{_API}.DIRECT.GET.{GENERATIONS_STREAM}.{KV_PREFIX}.>",
)
# Only the executor writes generations; nobody else may touch the KV stream's messages.
_NO_GENERATION_WRITES = (f"{KV_PREFIX}.>",)
# Events that only one role may publish (the rest of tr.evt.> is split below).
_FAULTS = (Subjects.FAULT_DETECTED, Subjects.NODE_HEALTH)


def _runtime_js(role: str) -> tuple[str, ...]:
    """What a role's own JetStream work needs: look at the streams (read-only), read the
    generations bucket, and pull, inspect and ack its own durable consumers (which ``admin``
    provisions)."""
    out = [f"{_API}.STREAM.INFO.{spec.name}" for spec in STREAMS]
    out += _GENERATION_READS
    for spec in CONSUMERS.values():
        if spec.service != role:
            continue
        out += [
            f"{_API}.CONSUMER.MSG.NEXT.{spec.stream}.{spec.durable}",
            f"{_API}.CONSUMER.INFO.{spec.stream}.{spec.durable}",
            f"$JS.ACK.{spec.stream}.{spec.durable}.>",
        ]
    return tuple(out)


def role_inbox(role: str) -> str:
    """The inbox prefix of a role's connections: replies to one role (a job credential the
    scheduler mints for the launcher, say) cannot be read by another."""
    return f"{ROLE_INBOX_PREFIX}.{role}"


def _rpc(service: str, verb: str = "*") -> str:
    return Subjects.rpc(service, verb)


def role_permissions(role: str) -> Permissions:
    """The NATS permissions of a trusted role (docs/security.md, "Who may do what").

    Raises:
        AuthError: ``role`` is not one of :data:`ROLES`.
    """
    if role == ADMIN:
        return Permissions(pub_allow=(">",), sub_allow=(">",), responses=True)
    if role not in ROLES:
        raise AuthError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
    inbox = (f"{role_inbox(role)}.>",)
    deny = _NO_GENERATION_WRITES
    runtime = _runtime_js(role)
    if role == "detector":
        return Permissions(
            pub_allow=(
                *runtime,
                *_FAULTS,
                "tr.int.detector.>",
                "tr.int.detector-critical.>",
                Subjects.dlq(role),
            ),
            sub_allow=(
                *inbox,
                _rpc(role, ">"),
                Subjects.TELEMETRY_ALL,
                Subjects.TELEMETRY_CRITICAL_ALL,
                Subjects.HEARTBEATS_ALL,
                "tr.int.detector.>",
                "tr.int.detector-critical.>",
            ),
            pub_deny=deny,
            responses=True,
        )
    if role == "scheduler":
        return Permissions(
            pub_allow=(
                *runtime,
                Subjects.MIGRATION_REQUESTED,
                Subjects.INCIDENT_OPENED,
                Subjects.INCIDENT_CLOSED,
                Subjects.INCIDENT_AMENDED,
                Subjects.DRAIN_REQUESTED,
                _rpc("spare_pool"),
                Subjects.dlq(role),
            ),
            sub_allow=(
                *inbox,
                _rpc(role, ">"),
                Subjects.HEARTBEATS_ALL,
                Subjects.JOB_FINISHED,
                CALLOUT_SUBJECT,
            ),
            pub_deny=deny,
            responses=True,
        )
    if role == "spare_pool":
        return Permissions(
            pub_allow=(*runtime, "tr.evt.spare.>", Subjects.dlq(role)),
            sub_allow=(*inbox, _rpc(role, ">"), Subjects.HEARTBEATS_ALL),
            pub_deny=deny,
            responses=True,
        )
    if role == "migration_executor":
        return Permissions(
            pub_allow=(
                *runtime,
                f"{KV_PREFIX}.>",
                Subjects.GENERATION_CHANGED,
                Subjects.MIGRATION_STARTED,
                Subjects.MIGRATION_COMPLETED,
                Subjects.MIGRATION_FAILED,
                _rpc("spare_pool"),
                "tr.ctl.launcher.*.spawn_spare",
                Subjects.FENCE_ALL,
                Subjects.dlq(role),
            ),
            sub_allow=(*inbox, _rpc(role, ">")),
            responses=True,
        )
    if role == "billing":
        return Permissions(
            # tenant_goodput: the export's goodput columns of each credit's term.
            pub_allow=(
                *runtime,
                Subjects.CREDIT_ISSUED,
                _rpc("scheduler", "tenant_goodput"),
                Subjects.dlq(role),
            ),
            sub_allow=(*inbox, _rpc(role, ">")),
            pub_deny=deny,
            responses=True,
        )
    # Job credentials are the launcher's business alone.
    no_minting = (_rpc("scheduler", "job_credentials"), _rpc("scheduler", "job_credentials_revoke"))
    if role == "api":
        return Permissions(
            pub_allow=(*runtime, "tr.rpc.>", Subjects.dlq(role)),
            sub_allow=(*inbox, _rpc(role, ">")),
            pub_deny=(*deny, *no_minting),
            responses=True,
        )
    if role == "node_agent":
        return Permissions(
            pub_allow=(Subjects.TELEMETRY_ALL, Subjects.TELEMETRY_CRITICAL_ALL),
            sub_allow=(*inbox, "tr.ctl.chaos.>"),
            responses=True,
        )
    if role == "launcher":
        return Permissions(
            pub_allow=(
                *runtime,
                Subjects.AGENT_REPORTS_ALL,
                Subjects.JOB_REGISTERED,
                Subjects.JOB_FINISHED,
                Subjects.JOB_RESTARTED,
                # A host launcher's liveness beats, its join and its look at the job's end.
                Subjects.HEARTBEATS_ALL,
                _rpc("scheduler", "join_host"),
                _rpc("scheduler", "job_get"),
                _rpc("spare_pool", "register"),
                *no_minting,
            ),
            sub_allow=(*inbox, "tr.ctl.launcher.>", Subjects.FENCE_ALL, Subjects.MIGRATION_FAILED),
            pub_deny=deny,
            responses=True,
        )
    # operator
    return Permissions(
        pub_allow=("tr.rpc.>", "tr.ctl.chaos.>", "tr.ctl.launcher.*.pid"),
        sub_allow=inbox,
        pub_deny=(*deny, *no_minting),
    )


def job_user(job_id: str) -> str:
    """The NATS user name of a job's credential."""
    return f"{JOB_USER_PREFIX}{job_id}"


def job_inbox_prefix(job_id: str) -> str:
    """The inbox prefix a job's connections must use (they may subscribe under it only)."""
    return f"{JOB_INBOX_PREFIX}{job_id}"


def generation_direct_get(job_id: str) -> str:
    """The JetStream direct-get subject of the last value of one job's generation key."""
    return f"$JS.API.DIRECT.GET.{GENERATIONS_STREAM}.{KV_PREFIX}.{job_id}"


def job_permissions(job_id: str) -> Permissions:
    """What a job's training processes may do: their own heartbeats and reports, and read
    their own generation (direct get of the last value, and live puts on the key)."""
    return Permissions(
        pub_allow=(
            Subjects.heartbeat(job_id),
            Subjects.agent_report(job_id),
            generation_direct_get(job_id),
        ),
        sub_allow=(f"{job_inbox_prefix(job_id)}.>", f"{KV_PREFIX}.{job_id}"),
    )
