"""Bearer tokens: issued by an operator, shown once, stored only as an HMAC of the secret.

Tokens are the API's own data, kept in Redis under ``tr:api``. A token is looked up by its
HMAC-SHA256 under a server-side pepper, and the stored digest is compared in constant time,
so neither the secret nor a timing side channel on it is exposed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from services.api.cache import ResponseCache
from torchrelay.settings import DEV_OPERATOR_TOKEN_PREFIX

ScopeName = Literal["operator", "tenant"]
TOKEN_PREFIX = "tr_"  # noqa: S105 - a prefix, not a secret


@dataclass(frozen=True)
class Principal:
    """Who a request acts as: an operator (every tenant) or one tenant."""

    scope: ScopeName
    tenant: str | None
    token_id: str

    @property
    def is_operator(self) -> bool:
        return self.scope == "operator"

    def sees(self, tenant: str | None) -> bool:
        """Whether this principal may read an object of ``tenant``."""
        return self.is_operator or (tenant is not None and tenant == self.tenant)


def new_token(*, development: bool = False) -> str:
    """A fresh random bearer token (256 bits); development tokens carry ``trdev_``."""
    prefix = DEV_OPERATOR_TOKEN_PREFIX if development else TOKEN_PREFIX
    return prefix + secrets.token_urlsafe(32)


def token_digest(pepper: bytes, token: str) -> str:
    """The stored form of a token: HMAC-SHA256 under the server's pepper, hex."""
    return hmac.new(pepper, token.encode(), hashlib.sha256).hexdigest()


class TokenStoreUnavailable(RuntimeError):
    """Redis, which holds the token digests, did not answer."""


async def connect_token_redis(url: str, timeout_s: float = 10.0) -> Any:
    """The API's Redis client (token digests): ``connect_redis``, which queues a burst.

    Raises:
        BusError: Redis did not answer within ``timeout_s`` (the message names REDIS_URL).
        SettingsError: the URL is malformed (the message names REDIS_URL).
    """
    from torchrelay.service import connect_redis

    return await connect_redis(url, timeout_s)


class TokenStore:
    """Issue and authenticate tokens; Redis holds only their digests."""

    def __init__(
        self, redis: Any, pepper: bytes, prefix: str = "tr:api", cache_s: float = 10.0
    ) -> None:
        self._redis = redis
        # token_digest on every request, keyed once: copying a keyed HMAC costs about half of
        # keying a new one (OpenSSL 3 looks the digest up again for each new one).
        self._keyed = hmac.new(pepper, digestmod=hashlib.sha256)
        self._prefix = prefix
        self._cache_s = cache_s
        # Known principals only: an unknown token is looked up again (it may be issued now).
        # A token asked for in the last quarter of its time is looked up again in the
        # background, so a busy token never falls out of the cache (all its requests would
        # then take the slow path at once); a revoked one is dropped by that lookup, and in
        # any case within cache_s of its revocation.
        self._cache: ResponseCache[Principal | None] = ResponseCache(
            cache_s, max_entries=10_000, keep=lambda p: p is not None, refresh_s=cache_s / 4
        )

    @classmethod
    async def open(
        cls, redis: Any, pepper: str | None, prefix: str = "tr:api", cache_s: float = 10.0
    ) -> TokenStore:
        """A store using ``pepper``, or the one kept in Redis (created once) when None."""
        if pepper:
            return cls(redis, pepper.encode(), prefix, cache_s)
        key = f"{prefix}:pepper"
        await redis.set(key, secrets.token_hex(32), nx=True)
        stored = await redis.get(key)
        value = stored.decode() if isinstance(stored, bytes) else str(stored)
        return cls(redis, value.encode(), prefix, cache_s)

    def _digest(self, token: str) -> str:
        """``token_digest(pepper, token)``."""
        mac = self._keyed.copy()
        mac.update(token.encode())
        return mac.hexdigest()

    def _key(self, digest: str) -> str:
        return f"{self._prefix}:token:{digest}"

    @property
    def _index(self) -> str:
        """token_id -> digest of every stored token (listing and revoking by id)."""
        return f"{self._prefix}:token_ids"

    def token_id(self, token: str) -> str:
        """The public id of ``token`` (the first 16 hex digits of its digest)."""
        return self._digest(token)[:16]

    async def store(self, token: str, scope: ScopeName, tenant: str | None = None) -> Principal:
        """Keep the digest of ``token`` with its scope (idempotent: a restart re-stores it)."""
        digest = self._digest(token)
        principal = Principal(scope=scope, tenant=tenant, token_id=digest[:16])
        key = self._key(digest)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(
            key,
            mapping={
                "digest": digest,
                "scope": scope,
                "tenant": tenant or "",
                "token_id": principal.token_id,
            },
        )
        pipe.hsetnx(key, "created_at", datetime.now(UTC).isoformat())  # a re-store keeps it
        pipe.hset(self._index, principal.token_id, digest)
        await pipe.execute()
        return principal

    async def listed(self) -> list[dict[str, str | None]]:
        """Every stored token's id, scope, tenant and creation time (never its secret),
        oldest first."""
        index = await self._redis.hgetall(self._index)
        digests = sorted(_text(d) for d in index.values())
        pipe = self._redis.pipeline(transaction=False)
        for digest in digests:
            pipe.hgetall(self._key(digest))
        rows = []
        for raw in await pipe.execute():
            record = {_text(k): _text(v) for k, v in raw.items()}
            if not record:
                continue  # revoked between the two reads
            rows.append(
                {
                    "token_id": record.get("token_id", ""),
                    "scope": record.get("scope", ""),
                    "tenant": record.get("tenant") or None,
                    "created_at": record.get("created_at") or None,
                }
            )
        rows.sort(key=lambda r: (r["created_at"] or "", r["token_id"] or ""))
        return rows

    async def revoke(self, token_id: str) -> bool:
        """Delete the token with ``token_id``; False when there is none.

        This process refuses it at once; another API replica within its token cache time.
        """
        raw = await self._redis.hget(self._index, token_id)
        if raw is None:
            return False
        digest = _text(raw)
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self._key(digest))
        pipe.hdel(self._index, token_id)
        await pipe.execute()
        self._cache.forget(digest)
        return True

    async def issue(self, scope: ScopeName, tenant: str | None = None) -> tuple[str, Principal]:
        """A new token and its principal; the caller shows the token once."""
        token = new_token()
        return token, await self.store(token, scope, tenant)

    def remembered(self, token: str) -> Principal | None:
        """The principal of ``token`` if it was authenticated within the cache time, else
        None (unknown, or not remembered: ask :meth:`authenticate`)."""
        if not token or len(token) > 512 or self._cache_s <= 0:
            return None
        return self._cache.kept(self._digest(token))

    async def authenticate(self, token: str) -> Principal | None:
        """The principal of ``token``, or None when it is unknown."""
        if not token or len(token) > 512:
            return None
        digest = self._digest(token)
        # Concurrent first requests with one token share one Redis lookup.
        return await self._cache.get(digest, lambda: self._lookup(digest))

    async def _lookup(self, digest: str) -> Principal | None:
        try:
            raw = await self._redis.hgetall(self._key(digest))
        except Exception as exc:
            raise TokenStoreUnavailable(
                f"the token store (Redis) did not answer: {type(exc).__name__}: {exc}"
            ) from exc
        if not raw:
            return None
        record = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
        if not hmac.compare_digest(record.get("digest", ""), digest):
            return None
        scope: ScopeName
        if record.get("scope") == "operator":
            scope = "operator"
        elif record.get("scope") == "tenant":
            scope = "tenant"
        else:
            return None
        return Principal(
            scope=scope,
            tenant=record.get("tenant") or None,
            token_id=record.get("token_id", digest[:16]),
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
