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

import base64
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

from torchrelay.contract import GENERATIONS_BUCKET, Subjects

log = logging.getLogger("torchrelay.auth")

CALLOUT_SUBJECT = "$SYS.REQ.USER.AUTH"
JOB_USER_PREFIX = "job."
# Inbox prefix of a job's connections: they may subscribe to replies under it only.
JOB_INBOX_PREFIX = "_INBOX_"
GENERATIONS_STREAM = f"KV_{GENERATIONS_BUCKET}"
KV_PREFIX = f"$KV.{GENERATIONS_BUCKET}"

SERVICE_ROLES = ("detector", "scheduler", "spare_pool", "migration_executor", "billing", "api")
ROLES = (*SERVICE_ROLES, "node_agent", "launcher", "operator")
# Break-glass superuser (every subject): recovery by hand, and the chaos tests that replay
# or forge events on purpose. No process of the stack uses it.
ADMIN = "admin"
USERS = (*ROLES, ADMIN)
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


# What every trusted process needs to use JetStream, request/reply and its dead letters.
_JS = ("$JS.API.>", "$JS.ACK.>", "$JS.FC.>")
# Only the executor writes generations; nobody else may touch the KV stream's messages.
_NO_GENERATION_WRITES = (
    f"{KV_PREFIX}.>",
    f"$JS.API.STREAM.PURGE.{GENERATIONS_STREAM}",
    f"$JS.API.STREAM.MSG.DELETE.{GENERATIONS_STREAM}",
    f"$JS.API.STREAM.DELETE.{GENERATIONS_STREAM}",
    f"$JS.API.STREAM.UPDATE.{GENERATIONS_STREAM}",
)
# Events that only one role may publish (the rest of tr.evt.> is split below).
_FAULTS = (Subjects.FAULT_DETECTED, Subjects.NODE_HEALTH)


def _rpc(service: str, verb: str = "*") -> str:
    return Subjects.rpc(service, verb)


def role_permissions(role: str) -> Permissions:
    """The NATS permissions of a trusted role (DESIGN.md §2 "Who may say what").

    Raises:
        AuthError: ``role`` is not one of :data:`ROLES`.
    """
    inbox = ("_INBOX.>",)
    deny = _NO_GENERATION_WRITES
    if role == "detector":
        return Permissions(
            pub_allow=(
                *_JS,
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
                *_JS,
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
            pub_allow=(*_JS, "tr.evt.spare.>", Subjects.dlq(role)),
            sub_allow=(*inbox, _rpc(role, ">"), Subjects.HEARTBEATS_ALL),
            pub_deny=deny,
            responses=True,
        )
    if role == "migration_executor":
        return Permissions(
            pub_allow=(
                *_JS,
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
            pub_allow=(*_JS, Subjects.CREDIT_ISSUED, Subjects.dlq(role)),
            sub_allow=(*inbox, _rpc(role, ">")),
            pub_deny=deny,
            responses=True,
        )
    if role == "api":
        return Permissions(
            pub_allow=(*_JS, "tr.rpc.>", Subjects.dlq(role)),
            sub_allow=(*inbox, _rpc(role, ">")),
            pub_deny=(*deny, _rpc("scheduler", "job_credentials")),
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
                *_JS,
                Subjects.AGENT_REPORTS_ALL,
                Subjects.JOB_REGISTERED,
                Subjects.JOB_FINISHED,
                _rpc("spare_pool", "register"),
                _rpc("scheduler", "job_credentials"),
                _rpc("scheduler", "job_credentials_revoke"),
            ),
            sub_allow=(*inbox, "tr.ctl.launcher.>", Subjects.FENCE_ALL, Subjects.MIGRATION_FAILED),
            pub_deny=deny,
            responses=True,
        )
    if role == "operator":
        return Permissions(
            pub_allow=(*_JS, "tr.rpc.>", "tr.ctl.chaos.>", "tr.ctl.launcher.*.pid"),
            sub_allow=(*inbox,),
            pub_deny=(*deny, _rpc("scheduler", "job_credentials")),
        )
    if role == ADMIN:
        return Permissions(pub_allow=(">",), sub_allow=(">",), responses=True)
    raise AuthError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")


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


class JobCredentialStore:
    """Job credentials in Redis under the scheduler's prefix; the password is stored hashed."""

    def __init__(self, redis: Any, prefix: str = "tr:scheduler") -> None:
        self._redis = redis
        self._prefix = prefix

    def _key(self, user: str) -> str:
        return f"{self._prefix}:jobcred:{user}"

    async def mint(
        self, job_id: str, tenant: str, ttl_s: float = DEFAULT_JOB_TTL_S
    ) -> tuple[str, str, float]:
        """A new credential of ``job_id`` (replacing an older one): user, password, expiry."""
        user = job_user(job_id)
        password = secrets.token_urlsafe(32)
        expires_at = time.time() + ttl_s
        record = {"job_id": job_id, "tenant": tenant, "hash": _hash(password), "exp": expires_at}
        await self._redis.set(self._key(user), json.dumps(record), ex=max(1, int(ttl_s) + 1))
        return user, password, expires_at

    async def revoke(self, job_id: str) -> bool:
        """Forget the credential of ``job_id``; True if there was one."""
        return bool(await self._redis.delete(self._key(job_user(job_id))))

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
            "auth_callout": {"issuer": self.issuer.public, "auth_users": list(USERS)},
        }
        return f"authorization {_conf_value(block)}\n"

    def redis_url(
        self, host: str, port: int, role: str | None = None, scheme: str = "redis"
    ) -> str:
        """The URL a process connects to Redis with (the ``default`` user's password, or
        ``role``'s own ACL user)."""
        if role is not None and role in self.redis_passwords:
            return f"{scheme}://{role}:{self.redis_passwords[role]}@{host}:{port}/0"
        return f"{scheme}://:{self.redis_password}@{host}:{port}/0"

    def redis_acl(self) -> str:
        """ACL users: each service under its own key prefix (``tr:<service>``)."""
        lines = [f"user default on >{self.redis_password} ~* &* +@all"]
        for role, password in sorted(self.redis_passwords.items()):
            lines.append(
                f"user {role} on >{password} ~tr:{role}:* ~tr:{role} &* +@all "
                "-flushall -flushdb -shutdown -config -acl -debug -module"
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
    passwords = {r: _read_or_new(secret_dir / f"nats-{r}.password", token) for r in USERS}
    redis_password = _read_or_new(secret_dir / "redis-default.password", token)
    redis_passwords = {
        r: _read_or_new(secret_dir / f"redis-{r}.password", token) for r in SERVICE_ROLES
    }
    bundle = AuthBundle(directory, issuer, passwords, redis_password, redis_passwords)
    for role in USERS:
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
    "ROLES",
    "USERS",
    "AuthBundle",
    "AuthError",
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
    "load_issuer",
    "role_permissions",
]
