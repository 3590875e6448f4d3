"""Job-scoped NATS credentials: the ``job_credentials`` verbs and the auth-callout responder.

The launcher asks ``tr.rpc.scheduler.job_credentials`` (with its own credential) for a user
of one job; the password is kept only hashed, under the scheduler's Redis prefix, with the
credential's expiry. When a job's process connects with it, the NATS server sends an
authorization request to ``$SYS.REQ.USER.AUTH``; :func:`setup_credentials` answers it with
a user JWT limited to the job's own subjects (:func:`torchrelay.auth.job_permissions`),
signed with the issuer seed the server trusts (``TORCHRELAY_AUTH_ISSUER_SEED_FILE``).

A job id is bound to the launcher that first minted for it (its secret ``claim``) and its
tenant; another claim, another tenant, or a second mint while a credential is live is
refused (``conflict``). The credential is revoked when the job ends (the launcher's
``job_credentials_revoke`` with its claim, and the ``job.finished`` event), and then the
job's live connections are closed through the system account (``revoker.cred``,
``TORCHRELAY_NATS_REVOKER_CREDENTIALS``); their reconnects are refused at the callout. It
also expires on its own.
"""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime
from typing import Any

from nats.aio.msg import Msg

from torchrelay.auth import (
    CALLOUT_SUBJECT,
    CredentialRefused,
    JobCredentialStore,
    answer_authorization,
    kick_user,
    load_issuer,
)
from torchrelay.bus import Bus, Conflict
from torchrelay.contract import (
    JobCredentials,
    JobCredentialsRequest,
    JobCredentialsRevoke,
    JobFinished,
    Subjects,
)
from torchrelay.service import ServiceContext

ISSUER_ENV = "TORCHRELAY_AUTH_ISSUER_SEED_FILE"
# The system-account user that may list and close connections (``revoker.cred``).
REVOKER_ENV = "TORCHRELAY_NATS_REVOKER_CREDENTIALS"
MULTI_HOST_REVOKE_GRACE_S = 30.0


async def _connect_revoker(ctx: ServiceContext) -> Bus | None:
    path = ctx.settings.nats_revoker_credentials or os.environ.get(REVOKER_ENV)
    if not path:
        ctx.readiness["revocation_closes_connections"] = "off"
        return None
    bus = await Bus.connect(
        ctx.settings.nats_url, "scheduler-revoker", credentials=str(path), timeout=10.0
    )
    ctx.closers.append(bus.close)
    ctx.readiness["revocation_closes_connections"] = "on"
    return bus


async def setup_credentials(ctx: ServiceContext) -> None:
    """Serve the credential verbs; answer auth callouts when the issuer seed is configured;
    end a revoked job's live connections when the revoker credential is configured."""
    store = JobCredentialStore(ctx.redis, ctx.prefix)
    revoker = await _connect_revoker(ctx)
    tasks: set[asyncio.Task[None]] = set()

    async def kick(job_id: str, users: list[str]) -> None:
        if revoker is None:
            return
        kicked = 0
        for user in users:
            try:
                kicked += await kick_user(revoker.nc, user, tag=f"job:{job_id}")
            except Exception as exc:  # the credential is gone anyway: reconnects are refused
                ctx.log.warning("closing the connections of job %s failed: %r", job_id, exc)
                return
        ctx.log.info("job connections closed", extra={"job_id": job_id, "count": kicked})

    async def end(job_id: str) -> None:
        await kick(job_id, await store.revoke(job_id))

    async def end_later(job_id: str) -> None:
        # A job across hosts is finished by the first launcher that sees its last step;
        # the other hosts' ranks are finishing too and still report: their credentials go
        # a little later (each launcher revokes its own seat as it ends).
        await asyncio.sleep(MULTI_HOST_REVOKE_GRACE_S)
        try:
            await end(job_id)
        except Exception as exc:
            ctx.log.warning("revoking the credentials of %s failed: %r", job_id, exc)

    async def job_credentials(body: dict[str, Any]) -> JobCredentials:
        req = JobCredentialsRequest.model_validate(body)
        try:
            user, password, expires_at = await store.mint(
                req.job_id, req.tenant, req.claim, req.ttl_s, seat=req.seat
            )
        except CredentialRefused as exc:
            ctx.log.warning("job credential refused: %s", exc, extra={"job_id": req.job_id})
            raise Conflict(str(exc), "job_id") from exc
        ctx.log.info("job credential issued", extra={"job_id": req.job_id, "user": user})
        return JobCredentials(
            job_id=req.job_id,
            user=user,
            password=password,
            expires_at=datetime.fromtimestamp(expires_at, UTC),
        )

    async def job_credentials_revoke(body: dict[str, Any]) -> dict[str, Any]:
        req = JobCredentialsRevoke.model_validate(body)
        try:
            users = await store.revoke(req.job_id, req.claim, req.seat)  # claim checked first
        except CredentialRefused as exc:
            raise Conflict(str(exc), "job_id") from exc
        await kick(req.job_id, users)
        ctx.log.info("job credential revoked", extra={"job_id": req.job_id})
        return {"job_id": req.job_id, "revoked": True}

    await ctx.serve("job_credentials", job_credentials)
    await ctx.serve("job_credentials_revoke", job_credentials_revoke)

    async def on_finished(msg: Msg) -> None:
        try:
            finished = JobFinished.model_validate_json(msg.data)
        except ValueError:
            return
        try:
            if len(await store.users(finished.job_id)) > 1:
                tasks.add(task := asyncio.create_task(end_later(finished.job_id)))
                task.add_done_callback(tasks.discard)
                return
            await end(finished.job_id)
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
