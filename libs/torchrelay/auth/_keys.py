"""nkeys and the NATS ``ed25519-nkey`` JWTs, on PyNaCl."""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

import nacl.exceptions
import nacl.signing


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
