"""Pure parts of torchrelay.auth: nkeys and JWTs, the permission tables, the callout answer."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import pytest

from torchrelay.auth import (
    ADMIN,
    ROLES,
    AuthError,
    JobGrant,
    NKey,
    answer_authorization,
    decode_jwt,
    encode_jwt,
    job_permissions,
    role_permissions,
)
from torchrelay.contract import Subjects
from torchrelay.launcher import resolve_credentials


def test_nkey_seed_and_public_key_have_the_nats_prefixes() -> None:
    key = NKey.generate()
    assert key.seed.startswith("SA")
    assert key.public.startswith("A")
    assert len(key.public) == 56
    assert NKey(key.seed).public == key.public


def test_jwt_round_trip_and_tampering_is_detected() -> None:
    key = NKey.generate()
    token = encode_jwt({"sub": "UABC", "nats": {"type": "user"}}, key)
    claims = decode_jwt(token)
    assert claims["iss"] == key.public
    assert claims["sub"] == "UABC"
    head, payload, sig = token.split(".")
    body = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    body["sub"] = "UXYZ"  # same issuer, altered claim, old signature
    altered = base64.urlsafe_b64encode(json.dumps(body).encode()).decode().rstrip("=")
    with pytest.raises(AuthError):
        decode_jwt(f"{head}.{altered}.{sig}")
    with pytest.raises(AuthError):
        decode_jwt("not-a-jwt")


def test_only_the_executor_may_write_generations_and_only_the_detector_faults() -> None:
    for role in ROLES:
        perms = role_permissions(role)
        writes_kv = any(s.startswith("$KV.") for s in perms.pub_allow)
        assert writes_kv == (role == "migration_executor"), role
        faults = Subjects.FAULT_DETECTED in perms.pub_allow
        assert faults == (role == "detector"), role
        assert ">" not in perms.pub_allow, role
    assert role_permissions(ADMIN).pub_allow == (">",)
    with pytest.raises(AuthError):
        role_permissions("root")


def test_job_permissions_name_only_the_job() -> None:
    perms = job_permissions("j1")
    assert perms.pub_allow == (
        "tr.hb.j1",
        "tr.evt.report.j1",
        "$JS.API.DIRECT.GET.KV_tr_generations.$KV.tr_generations.j1",
    )
    assert perms.sub_allow == ("_INBOX_j1.>", "$KV.tr_generations.j1")
    assert all("*" not in s and ">" not in s.removesuffix(".>") for s in perms.pub_allow)


def _request(server: NKey, user: str, password: str) -> str:
    claims = {
        "sub": "UUSERNKEY",
        "aud": "nats-authorization-request",
        "nats": {
            "server_id": {"id": server.public, "name": "n"},
            "user_nkey": "UUSERNKEY",
            "connect_opts": {"user": user, "pass": password},
            "type": "authorization_request",
            "version": 2,
        },
    }
    return encode_jwt(claims, server)


def test_callout_answer_grants_the_job_or_says_why_not() -> None:
    server, issuer = NKey.generate(), NKey.generate()

    async def lookup(user: str, password: str) -> JobGrant | None:
        if (user, password) == ("job.j1", "good"):
            return JobGrant("j1", "acme", time.time() + 60)
        return None

    ok = decode_jwt(
        asyncio.run(answer_authorization(_request(server, "job.j1", "good"), issuer, lookup))
    )
    assert ok["aud"] == server.public
    assert ok["sub"] == "UUSERNKEY"
    assert ok["iss"] == issuer.public
    user = decode_jwt(ok["nats"]["jwt"])
    assert user["aud"] == "$G"
    assert user["nats"]["pub"]["allow"] == list(job_permissions("j1").pub_allow)
    assert "exp" not in user  # nats-py would close, not reconnect, an expired connection

    for who, pw in (("job.j1", "bad"), ("scheduler", "x"), ("", "")):
        refused = decode_jwt(
            asyncio.run(answer_authorization(_request(server, who, pw), issuer, lookup))
        )
        assert refused["nats"]["error"]
        assert "jwt" not in refused["nats"]


def test_credentials_are_found_in_the_environment_or_stack_json(tmp_path: Path) -> None:
    (tmp_path / "stack.json").write_text(
        json.dumps(
            {
                "nats_url": "nats://127.0.0.1:4222",
                "credentials": {"launcher": "/s/launcher.cred", "operator": "/s/operator.cred"},
            }
        )
    )
    home = {"TORCHRELAY_HOME": str(tmp_path)}
    assert resolve_credentials("launcher", home) == "/s/launcher.cred"
    assert resolve_credentials("operator", home) == "/s/operator.cred"
    assert resolve_credentials("admin", home) is None
    given = {**home, "TORCHRELAY_NATS_CREDENTIALS": "/x.cred"}
    assert resolve_credentials("launcher", given) == "/x.cred"
    # Another server than the stack's: its credentials do not apply.
    other = {**home, "NATS_URL": "nats://elsewhere:4222"}
    assert resolve_credentials("launcher", other) is None
    assert resolve_credentials("launcher", {"TORCHRELAY_HOME": str(tmp_path / "none")}) is None
