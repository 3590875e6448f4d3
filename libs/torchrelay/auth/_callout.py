"""NATS auth callout: job credentials checked, job-scoped user JWTs issued."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from torchrelay.auth._keys import (
    AuthError,
    NKey,
    decode_jwt,
    encode_jwt,
)
from torchrelay.auth._roles import (
    DEFAULT_JOB_TTL_S,
    JOB_USER_PREFIX,
    job_permissions,
    job_user,
)

log = logging.getLogger("torchrelay.auth")

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


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


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

    def _users_key(self, job_id: str) -> str:
        return f"{self._prefix}:jobusers:{job_id}"

    async def mint(
        self,
        job_id: str,
        tenant: str,
        claim: str,
        ttl_s: float = DEFAULT_JOB_TTL_S,
        seat: str | None = None,
    ) -> tuple[str, str, float]:
        """A new credential of ``job_id`` (of one ``seat`` of it): user, password, expiry.

        A job across hosts has one credential per host (``seat``), all bound to the same
        claim; a one-host job has the one credential of ``job_user(job_id)``.

        Raises:
            CredentialRefused: the job is claimed by another launcher or tenant, or the
                seat has a live credential.
        """
        ttl = max(1, int(ttl_s) + 1)
        claim_record = json.dumps({"tenant": tenant, "hash": _hash(claim)})
        if not await self._redis.set(self._claim_key(job_id), claim_record, ex=ttl, nx=True):
            await self._check_claim(job_id, claim, tenant)
        user = job_user(job_id) if seat is None else f"{job_user(job_id)}.{seat}"
        password = secrets.token_urlsafe(32)
        expires_at = time.time() + ttl_s
        record = {"job_id": job_id, "tenant": tenant, "hash": _hash(password), "exp": expires_at}
        if not await self._redis.set(self._key(user), json.dumps(record), ex=ttl, nx=True):
            where = "" if seat is None else f" for seat {seat}"
            raise CredentialRefused(
                f"job {job_id} already has a live credential{where}; it is not replaced (it "
                "ends when the job finishes, is revoked, or expires)"
            )
        if seat is not None:
            await self._redis.sadd(self._users_key(job_id), user)
            await self._redis.expire(self._users_key(job_id), ttl)
        return user, password, expires_at

    async def users(self, job_id: str) -> list[str]:
        """Every NATS user name the job's credentials may have (the one-host one first)."""
        seats = sorted(_text(u) for u in await self._redis.smembers(self._users_key(job_id)))
        return [job_user(job_id), *seats]

    async def revoke(
        self, job_id: str, claim: str | None = None, seat: str | None = None
    ) -> list[str]:
        """Forget credentials of ``job_id``; returns the user names whose credential went.

        ``claim`` None is the scheduler's own revocation (the job finished): every seat
        goes. Otherwise it must be the claim the credential was minted with, and only the
        ``seat`` named (or the one-host credential) goes; the claim stays while a seat does.

        Raises:
            CredentialRefused: ``claim`` is not the job's.
        """
        if claim is not None:
            await self._check_claim(job_id, claim, None)
        if claim is None:
            users = await self.users(job_id)
            await self._redis.delete(
                *(self._key(u) for u in users), self._claim_key(job_id), self._users_key(job_id)
            )
            return users
        user = job_user(job_id) if seat is None else f"{job_user(job_id)}.{seat}"
        removed = await self._redis.delete(self._key(user))
        if seat is not None:
            await self._redis.srem(self._users_key(job_id), user)
        if not await self._redis.scard(self._users_key(job_id)):
            await self._redis.delete(self._claim_key(job_id))
        return [user] if removed else []

    async def check_claim(self, job_id: str, claim: str | None) -> None:
        """Refuse ``claim`` when the job is bound to another one (no claim yet: allowed).

        Raises:
            CredentialRefused: the job is claimed and ``claim`` is missing or differs.
        """
        raw = await self._redis.get(self._claim_key(job_id))
        if raw is None:
            return
        if claim is None:
            raise CredentialRefused(f"job {job_id} is claimed: its launchers must give its claim")
        await self._check_claim(job_id, claim, None)

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
