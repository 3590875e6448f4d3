"""Job-scoped NATS credentials: the ``job_credentials`` verbs and the auth-callout responder.

The launcher asks ``tr.rpc.scheduler.job_credentials`` (with its own credential) for a user
of one job; the password is kept only hashed, under the scheduler's Redis prefix, with the
credential's expiry. When a job's process connects with it, the NATS server sends an
authorization request to ``$SYS.REQ.USER.AUTH``; :func:`setup_credentials` answers it with
a user JWT limited to the job's own subjects (:func:`torchrelay.auth.job_permissions`),
signed with the issuer seed the server trusts (``TORCHRELAY_AUTH_ISSUER_SEED_FILE``). The
credential is revoked when the job ends (the launcher's ``job_credentials_revoke`` and the
``job.finished`` event) and expires on its own.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import Any

from nats.aio.msg import Msg

from torchrelay.auth import (
    CALLOUT_SUBJECT,
    JobCredentialStore,
    answer_authorization,
    load_issuer,
)
from torchrelay.contract import (
    JobCredentials,
    JobCredentialsRequest,
    JobFinished,
    Message,
    Subjects,
    Token,
)
from torchrelay.service import ServiceContext

ISSUER_ENV = "TORCHRELAY_AUTH_ISSUER_SEED_FILE"


class _Revoke(Message):
    job_id: Token


async def setup_credentials(ctx: ServiceContext) -> None:
    """Serve the credential verbs; answer auth callouts when the issuer seed is configured."""
    store = JobCredentialStore(ctx.redis, ctx.prefix)

    async def job_credentials(body: dict[str, Any]) -> JobCredentials:
        req = JobCredentialsRequest.model_validate(body)
        user, password, expires_at = await store.mint(req.job_id, req.tenant, req.ttl_s)
        ctx.log.info("job credential issued", extra={"job_id": req.job_id, "user": user})
        return JobCredentials(
            job_id=req.job_id,
            user=user,
            password=password,
            expires_at=datetime.fromtimestamp(expires_at, UTC),
        )

    async def job_credentials_revoke(body: dict[str, Any]) -> dict[str, Any]:
        req = _Revoke.model_validate(body)
        revoked = await store.revoke(req.job_id)
        ctx.log.info("job credential revoked", extra={"job_id": req.job_id})
        return {"job_id": req.job_id, "revoked": revoked}

    await ctx.serve("job_credentials", job_credentials)
    await ctx.serve("job_credentials_revoke", job_credentials_revoke)

    async def on_finished(msg: Msg) -> None:
        try:
            finished = JobFinished.model_validate_json(msg.data)
        except ValueError:
            return
        try:
            await store.revoke(finished.job_id)
        except Exception as exc:  # Redis down: the credential still expires on its own
            ctx.log.warning("revoking the credential of %s failed: %r", finished.job_id, exc)

    await ctx.bus.subscribe_core(Subjects.JOB_FINISHED, on_finished, queue="scheduler-creds")

    seed_file = ctx.settings.auth_issuer_seed_file or os.environ.get(ISSUER_ENV)
    if not seed_file:
        ctx.readiness["auth_callout"] = "off"
        return
    issuer = load_issuer(seed_file)

    async def on_auth(msg: Msg) -> None:
        try:
            response = await answer_authorization(msg.data, issuer, store.check)
        except Exception as exc:
            # No answer: the server refuses the connection when its callout times out.
            ctx.log.warning("auth callout request not answered: %r", exc)
            return
        await msg.respond(response.encode())

    await ctx.bus.subscribe_core(CALLOUT_SUBJECT, on_auth, queue="scheduler-auth")
    ctx.readiness["auth_callout"] = "on"
