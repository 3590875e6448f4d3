"""Who may say what on the bus: roles, NATS permissions, credentials and job-scoped users.

Every trusted process (each service, the detector node agents, the launcher, the operator's
CLI) connects with its own static NATS user whose permissions the generated server
configuration lists (:func:`role_permissions`). Every other connection -- the training
processes of a job -- goes through NATS *auth callout*: the server sends an authorization
request JWT to ``$SYS.REQ.USER.AUTH``; the scheduler's responder checks the job credential
the launcher obtained for that job (:class:`JobCredentialStore`) and answers with a user JWT
that may publish only the job's heartbeat and report subjects and read only the job's own
generation key (:func:`job_permissions`), expiring with the credential.

The JWTs are NATS's ``ed25519-nkey`` JWTs; nkeys (base32 of prefix byte + key + CRC-16) are
encoded here on PyNaCl.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nacl.exceptions
import nacl.signing

from torchrelay.contract import CONSUMERS, GENERATIONS_BUCKET, STREAMS, Subjects
from torchrelay.redis_acl import redis_commands

log = logging.getLogger("torchrelay.auth")

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


class AuthError(RuntimeError):
    """Authentication material is missing or invalid; the message says which."""


# --------------------------------------------------------------------------- nkeys, JWT

_PREFIX_SEED = 18 << 3
_PREFIX_ACCOUNT = 0 << 3
_PREFIX_USER = 20 << 3


def _crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def _b32(raw: bytes) -> str:
    return base64.b32encode(raw).decode().rstrip("=")


def _unb32(text: str) -> bytes:
    return base64.b32decode(text + "=" * (-len(text) % 8))


def _encode_key(prefix: int, key: bytes) -> str:
    raw = bytes([prefix]) + key
    return _b32(raw + _crc16(raw).to_bytes(2, "little"))


def _encode_seed(prefix: int, seed: bytes) -> str:
    raw = bytes([_PREFIX_SEED | (prefix >> 5), (prefix & 31) << 3]) + seed
    return _b32(raw + _crc16(raw).to_bytes(2, "little"))


def _check(raw: bytes) -> bytes:
    body, crc = raw[:-2], raw[-2:]
    if _crc16(body).to_bytes(2, "little") != crc:
        raise AuthError("nkey checksum mismatch")
    return body


@dataclass(frozen=True)
class NKey:
    """An Ed25519 key pair in NATS nkey encoding (a seed ``S...``, a public key ``A...``)."""

    seed: str

    @classmethod
    def generate(cls, prefix: int = _PREFIX_ACCOUNT) -> NKey:
        return cls(_encode_seed(prefix, secrets.token_bytes(32)))

    def _decoded(self) -> tuple[int, bytes]:
        body = _check(_unb32(self.seed))
        if body[0] & 0xF8 != _PREFIX_SEED:
            raise AuthError("not an nkey seed")
        prefix = ((body[0] & 7) << 5) | (body[1] >> 3)
        return prefix, body[2:]

    @property
    def public(self) -> str:
        prefix, raw = self._decoded()
        return _encode_key(prefix, bytes(nacl.signing.SigningKey(raw).verify_key))

    def sign(self, data: bytes) -> bytes:
        return bytes(nacl.signing.SigningKey(self._decoded()[1]).sign(data).signature)


def verify_key(public: str) -> nacl.signing.VerifyKey:
    """The Ed25519 key of an nkey public key (``N...`` server, ``A...`` account, ...)."""
    body = _check(_unb32(public))
    return nacl.signing.VerifyKey(body[1:])


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


_JWT_HEADER = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())


def encode_jwt(claims: dict[str, Any], issuer: NKey) -> str:
    """A NATS JWT of ``claims`` issued and signed by ``issuer`` (``jti``/``iat``/``iss`` set)."""
    body = dict(claims)
    body.setdefault("iat", int(time.time()))
    body["iss"] = issuer.public
    body.pop("jti", None)
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()
    body["jti"] = _b32(digest)
    payload = _b64(json.dumps(body).encode())
    signing_input = f"{_JWT_HEADER}.{payload}".encode()
    return f"{_JWT_HEADER}.{payload}.{_b64(issuer.sign(signing_input))}"


def decode_jwt(token: str, verify: bool = True) -> dict[str, Any]:
    """The claims of a NATS JWT, checking its signature against its ``iss``.

    Raises:
        AuthError: the token is malformed or its signature does not verify.
    """
    try:
        head, payload, sig = token.strip().split(".")
        claims: dict[str, Any] = json.loads(_unb64(payload))
        if verify:
            verify_key(str(claims["iss"])).verify(f"{head}.{payload}".encode(), _unb64(sig))
    except (ValueError, KeyError, nacl.exceptions.BadSignatureError) as exc:
        raise AuthError(f"invalid JWT: {exc}") from exc
    return claims


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
            pub_allow=(*runtime, Subjects.CREDIT_ISSUED, Subjects.dlq(role)),
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


# --------------------------------------------------------------------------- auth callout


@dataclass(frozen=True)
class JobGrant:
    """A job credential that a responder accepted: the job and when the credential ends."""

    job_id: str
    tenant: str
    expires_at: float


Lookup = Callable[[str, str], Awaitable[JobGrant | None]]


async def answer_authorization(request_jwt: bytes | str, issuer: NKey, lookup: Lookup) -> str:
    """The authorization-response JWT for one auth-callout request.

    The response grants a user JWT with :func:`job_permissions` when ``lookup(user,
    password)`` of the connect options finds a live job credential, and an error otherwise.
    """
    text = request_jwt.decode() if isinstance(request_jwt, bytes) else request_jwt
    req = decode_jwt(text)
    nats_claims = req.get("nats") or {}
    server_id = str((nats_claims.get("server_id") or {}).get("id") or "")
    user_nkey = str(nats_claims.get("user_nkey") or "")
    opts = nats_claims.get("connect_opts") or {}
    user = str(opts.get("user") or "")
    password = str(opts.get("pass") or "")
    grant: JobGrant | None = None
    error = ""
    if not user.startswith(JOB_USER_PREFIX) or not password:
        error = f"user {user or '(none)'!r} is not a job credential"
    else:
        grant = await lookup(user, password)
        if grant is None:
            error = f"job credential of {user!r} is unknown, revoked or expired"
    response: dict[str, Any] = {
        "sub": user_nkey,
        "aud": server_id,
        "nats": {"type": "authorization_response", "version": 2},
    }
    if grant is not None:
        # No ``exp``: nats-py closes (does not reconnect) a connection whose user JWT
        # expires, which would kill a long training job. The credential's expiry and
        # revocation are checked at every connect and reconnect instead.
        user_claims = {
            "sub": user_nkey,
            "aud": "$G",
            "name": user,
            "nats": {
                **job_permissions(grant.job_id).as_jwt(),
                "type": "user",
                "version": 2,
                "tags": [f"job:{grant.job_id}", f"tenant:{grant.tenant}"],
            },
        }
        response["nats"]["jwt"] = encode_jwt(user_claims, issuer)
    else:
        response["nats"]["error"] = error
        log.warning("NATS connection refused by the auth callout: %s", error)
    return encode_jwt(response, issuer)


def _hash(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


class CredentialRefused(AuthError):
    """A mint or revoke the store refuses: another launcher's job, another tenant, or a live
    credential that would be replaced."""


class JobCredentialStore:
    """Job credentials in Redis under the scheduler's prefix; the password is stored hashed.

    The first launcher to mint for a job id claims it with a secret of its own (stored
    hashed): minting or revoking for that job needs the same claim, for the same tenant, and
    a live credential is never replaced.
    """

    def __init__(self, redis: Any, prefix: str = "tr:scheduler") -> None:
        self._redis = redis
        self._prefix = prefix

    def _key(self, user: str) -> str:
        return f"{self._prefix}:jobcred:{user}"

    def _claim_key(self, job_id: str) -> str:
        return f"{self._prefix}:jobclaim:{job_id}"

    async def _check_claim(self, job_id: str, claim: str, tenant: str | None) -> None:
        raw = await self._redis.get(self._claim_key(job_id))
        if raw is None:
            raise CredentialRefused(f"job {job_id} has no credential to revoke")
        record = json.loads(raw)
        if not secrets.compare_digest(str(record["hash"]), _hash(claim)):
            raise CredentialRefused(f"job {job_id} belongs to another launcher (claim differs)")
        if tenant is not None and record["tenant"] != tenant:
            raise CredentialRefused(
                f"job {job_id} belongs to tenant {record['tenant']!r}, not {tenant!r}"
            )

    async def mint(
        self, job_id: str, tenant: str, claim: str, ttl_s: float = DEFAULT_JOB_TTL_S
    ) -> tuple[str, str, float]:
        """A new credential of ``job_id``: user, password, expiry.

        Raises:
            CredentialRefused: the job is claimed by another launcher or tenant, or it has
                a live credential.
        """
        ttl = max(1, int(ttl_s) + 1)
        claim_record = json.dumps({"tenant": tenant, "hash": _hash(claim)})
        if not await self._redis.set(self._claim_key(job_id), claim_record, ex=ttl, nx=True):
            await self._check_claim(job_id, claim, tenant)
        user = job_user(job_id)
        password = secrets.token_urlsafe(32)
        expires_at = time.time() + ttl_s
        record = {"job_id": job_id, "tenant": tenant, "hash": _hash(password), "exp": expires_at}
        if not await self._redis.set(self._key(user), json.dumps(record), ex=ttl, nx=True):
            raise CredentialRefused(
                f"job {job_id} already has a live credential; it is not replaced (it ends "
                "when the job finishes, is revoked, or expires)"
            )
        return user, password, expires_at

    async def revoke(self, job_id: str, claim: str | None = None) -> bool:
        """Forget the credential of ``job_id`` and its claim; True if there was one.

        ``claim`` None is the scheduler's own revocation (the job finished); otherwise it
        must be the claim the credential was minted with.

        Raises:
            CredentialRefused: ``claim`` is not the job's.
        """
        if claim is not None:
            await self._check_claim(job_id, claim, None)
        removed = await self._redis.delete(self._key(job_user(job_id)), self._claim_key(job_id))
        return bool(removed)

    async def check(self, user: str, password: str) -> JobGrant | None:
        """The grant of a live credential matching ``user``/``password``, else None."""
        raw = await self._redis.get(self._key(user))
        if raw is None:
            return None
        record = json.loads(raw)
        if not secrets.compare_digest(str(record["hash"]), _hash(password)):
            return None
        if float(record["exp"]) <= time.time():
            return None
        return JobGrant(str(record["job_id"]), str(record["tenant"]), float(record["exp"]))


async def kick_user(nc: Any, user: str, tag: str | None = None, wait_s: float = 0.5) -> int:
    """Close every live connection of ``user`` (or carrying ``tag``) on every server: the
    system account's ``CONNZ`` ping finds them, ``KICK`` closes them. ``nc`` is a
    connection of the :data:`REVOKER` user. Returns how many connections were closed."""
    replies: list[dict[str, Any]] = []

    async def _collect(msg: Any) -> None:
        with contextlib.suppress(ValueError):
            replies.append(json.loads(msg.data))

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=_collect)
    try:
        query = {"auth": True, "limit": 100_000}
        await nc.publish("$SYS.REQ.SERVER.PING.CONNZ", json.dumps(query).encode(), reply=inbox)
        await asyncio.sleep(wait_s)  # every server of a cluster answers
    finally:
        await sub.unsubscribe()
    kicked = 0
    for reply in replies:
        server_id = str((reply.get("server") or {}).get("id") or "")
        for conn in (reply.get("data") or {}).get("connections") or []:
            tags = conn.get("tags") or []
            if conn.get("authorized_user") != user and (tag is None or tag not in tags):
                continue
            body = json.dumps({"cid": conn["cid"]}).encode()
            await nc.request(f"$SYS.REQ.SERVER.{server_id}.KICK", body, timeout=2.0)
            kicked += 1
    return kicked


# --------------------------------------------------------------------------- generated files


def _conf_value(value: Any, indent: str = "") -> str:
    if isinstance(value, dict):
        inner = indent + "  "
        items = "\n".join(f"{inner}{k}: {_conf_value(v, inner)}" for k, v in value.items())
        return "{\n" + items + f"\n{indent}}}"
    if isinstance(value, list):
        return "[" + ", ".join(_conf_value(v, indent) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(str(value))


@dataclass
class AuthBundle:
    """The generated authentication material of one deployment (one directory)."""

    directory: Path
    issuer: NKey
    passwords: dict[str, str]
    redis_password: str
    redis_passwords: dict[str, str] = field(default_factory=dict)

    def cred_path(self, role: str) -> Path:
        """The ``user:password`` file of ``role`` (mode 0600)."""
        return self.directory / f"{role}.cred"

    @property
    def nats_conf_path(self) -> Path:
        """The ``authorization { ... }`` block to include in the server configuration."""
        return self.directory / "nats-auth.conf"

    @property
    def redis_acl_path(self) -> Path:
        """The Redis ACL file (``aclfile``): one user per service."""
        return self.directory / "redis-users.acl"

    def nats_url(self, url: str, role: str) -> str:
        """``url`` with ``role``'s user and password in it (for tools that take one URL)."""
        scheme, _, rest = url.partition("://")
        return f"{scheme}://{role}:{self.passwords[role]}@{rest}"

    def nats_authorization(self) -> str:
        """The ``authorization`` block: one user per role, and the callout for the rest."""
        users = [
            {
                "user": role,
                "password": self.passwords[role],
                "permissions": role_permissions(role).as_config(),
            }
            for role in USERS
        ]
        block = {
            "users": users,
            "auth_callout": {"issuer": self.issuer.public, "auth_users": [*USERS, REVOKER]},
        }
        revoker = Permissions(
            pub_allow=("$SYS.REQ.SERVER.PING.CONNZ", "$SYS.REQ.SERVER.*.KICK"),
            sub_allow=(f"{role_inbox(REVOKER)}.>",),
        )
        accounts = {
            SYSTEM_ACCOUNT: {
                "users": [
                    {
                        "user": REVOKER,
                        "password": self.passwords[REVOKER],
                        "permissions": revoker.as_config(),
                    }
                ]
            }
        }
        return (
            f"authorization {_conf_value(block)}\n"
            f"accounts {_conf_value(accounts)}\n"
            f"system_account: {SYSTEM_ACCOUNT}\n"
        )

    def redis_url(
        self, host: str, port: int, role: str | None = None, scheme: str = "redis"
    ) -> str:
        """The URL a process connects to Redis with (the ``default`` user's password, or
        ``role``'s own ACL user)."""
        if role is not None and role in self.redis_passwords:
            return f"{scheme}://{role}:{self.redis_passwords[role]}@{host}:{port}/0"
        return f"{scheme}://:{self.redis_password}@{host}:{port}/0"

    def redis_acl(self) -> str:
        """ACL users: ``default`` (probes, recovery) may do anything; each service only its
        own keys (``tr:<service>``, ``tr:<service>:*``), no Pub/Sub channel, and only the
        commands it uses (:func:`redis_commands`)."""
        lines = [f"user default on >{self.redis_password} ~* &* +@all"]
        for role, password in sorted(self.redis_passwords.items()):
            allowed = " ".join(f"+{c}" for c in redis_commands(role))
            lines.append(
                f"user {role} on >{password} resetkeys ~tr:{role}:* ~tr:{role} "
                f"resetchannels -@all {allowed}"
            )
        return "\n".join(lines) + "\n"


def _write_secret(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def _read_or_new(path: Path, make: Callable[[], str]) -> str:
    if path.exists():
        return path.read_text().strip()
    value = make()
    _write_secret(path, value)  # no newline: the value goes into URLs as it is
    return value


def ensure_bundle(directory: Path) -> AuthBundle:
    """Load the authentication material under ``directory``, generating what is missing.

    Secrets already there are kept (a restarted stack keeps its credentials); the derived
    files (``nats-auth.conf``, ``<role>.cred``, ``redis-users.acl``) are rewritten.
    """
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    issuer = NKey(_read_or_new(directory / "issuer.seed", lambda: NKey.generate().seed))

    def token() -> str:
        return secrets.token_urlsafe(24)

    secret_dir = directory / "secrets"
    secret_dir.mkdir(exist_ok=True)
    os.chmod(secret_dir, 0o700)
    passwords = {
        r: _read_or_new(secret_dir / f"nats-{r}.password", token) for r in (*USERS, REVOKER)
    }
    redis_password = _read_or_new(secret_dir / "redis-default.password", token)
    redis_passwords = {
        r: _read_or_new(secret_dir / f"redis-{r}.password", token) for r in SERVICE_ROLES
    }
    bundle = AuthBundle(directory, issuer, passwords, redis_password, redis_passwords)
    for role in (*USERS, REVOKER):
        _write_secret(bundle.cred_path(role), f"{role}:{passwords[role]}\n")
    _write_secret(bundle.nats_conf_path, bundle.nats_authorization())
    _write_secret(bundle.redis_acl_path, bundle.redis_acl())
    _write_secret(directory / "redis.password", redis_password)
    return bundle


def compose_env_lines(bundle: AuthBundle) -> str:
    """The ``.env`` lines docker-compose.yml reads the Redis passwords from."""
    lines = [f"REDIS_PASSWORD={bundle.redis_password}"]
    lines += [
        f"REDIS_{role.upper()}_PASSWORD={password}"
        for role, password in sorted(bundle.redis_passwords.items())
    ]
    return "\n".join(lines) + "\n"


def cmd_auth(args: Any) -> int:
    """``torchrelay auth init --out DIR``: the credentials of an external deployment.

    Writes (or completes, keeping existing secrets) the NATS authorization block, one
    ``user:password`` file per role, the auth-callout issuer seed, the Redis ACL file and
    ``compose.env`` (the Redis passwords for docker-compose's ``.env``).
    """
    out = Path(args.out)
    bundle = ensure_bundle(out)
    _write_secret(out / "compose.env", compose_env_lines(bundle))
    print(f"torchrelay auth: credentials in {out.resolve()} (mode 0600):")
    print(f"  {bundle.nats_conf_path.name:<22} NATS users, permissions, auth callout (servers)")
    for role in USERS:
        print(f"  {bundle.cred_path(role).name:<22} NATS credential of {role}")
    print(f"  {bundle.cred_path(REVOKER).name:<22} the scheduler's system-account user (kicks)")
    print("  issuer.seed            the scheduler signs job-scoped users with it")
    print(f"  {bundle.redis_acl_path.name:<22} Redis users (redis-server --aclfile)")
    print("  compose.env            Redis passwords: append to docker-compose's .env")
    return 0


def load_issuer(path: str | Path) -> NKey:
    """The callout issuer's seed from a file (``TORCHRELAY_AUTH_ISSUER_SEED_FILE``)."""
    try:
        return NKey(Path(path).read_text().strip())
    except OSError as exc:
        raise AuthError(f"cannot read the auth-callout issuer seed {path}: {exc}") from exc


__all__ = [
    "ADMIN",
    "CALLOUT_SUBJECT",
    "REVOKER",
    "ROLES",
    "ROLE_INBOX_PREFIX",
    "USERS",
    "AuthBundle",
    "AuthError",
    "CredentialRefused",
    "JobCredentialStore",
    "JobGrant",
    "NKey",
    "Permissions",
    "answer_authorization",
    "cmd_auth",
    "compose_env_lines",
    "decode_jwt",
    "encode_jwt",
    "ensure_bundle",
    "generation_direct_get",
    "job_inbox_prefix",
    "job_permissions",
    "job_user",
    "kick_user",
    "load_issuer",
    "redis_commands",
    "role_inbox",
    "role_permissions",
]
