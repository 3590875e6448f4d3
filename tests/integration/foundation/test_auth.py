"""Who may say what, against a real ``nats-server`` and ``redis-server`` started with the
configuration ``torchrelay up`` generates (``torchrelay.auth.ensure_bundle``).

The scheduler's auth-callout responder (``services.scheduler.credentials``) is run as the
service runs it; every refusal asserted here comes from the server.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
import redis.asyncio as aioredis
import redis.exceptions

from torchrelay.auth import ensure_bundle, generation_direct_get
from torchrelay.bus import Bus, BusError, PermissionRefused, TlsFiles
from torchrelay.contract import (
    AgentReport,
    FaultAction,
    FaultDetected,
    FaultKind,
    Generation,
    Heartbeat,
    RankAssignment,
    ReportKind,
    Role,
    Severity,
    Subjects,
    make_event_id,
)
from torchrelay.runtime import nats_server

from .authstack import CLAIM, Plane, Servers, plane, refused, role_bus, servers

__all__ = ["plane", "servers"]  # fixtures


async def _job_credential(servers: Servers, launcher_bus: Bus, job_id: str, tmp: Path) -> str:
    """What the launcher does: ask the scheduler, write the file 0600."""
    got = await launcher_bus.request(
        Subjects.rpc("scheduler", "job_credentials"),
        {"job_id": job_id, "tenant": "acme", "claim": CLAIM},
    )
    path = tmp / f"{job_id}.cred"
    path.write_text(f"{got['user']}:{got['password']}\n")
    path.chmod(0o600)
    return str(path)


def _generation(job_id: str, number: int) -> Generation:
    member = f"{job_id}-w0"
    return Generation(
        job_id=job_id,
        generation=number,
        world_size=1,
        ranks=[RankAssignment(rank=0, member_id=member, node="n0", gpu=0)],
        store_member=member,
        store_addr="127.0.0.1:1",
    )


def _report(job_id: str, tag: str) -> AgentReport:
    return AgentReport(
        event_id=make_event_id("auth-test", job_id, tag),
        source=f"{job_id}-w0",
        kind=ReportKind.JOINED,
        job_id=job_id,
        member_id=f"{job_id}-w0",
        role=Role.WORKER,
        rank=0,
        generation=1,
        step=1,
    )


async def test_job_credential_reaches_only_its_own_job(
    servers: Servers, plane: Plane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    launcher = await role_bus(servers, "launcher")
    try:
        cred_a = await _job_credential(servers, launcher, "job-a", tmp_path)
        await _job_credential(servers, launcher, "job-b", tmp_path)
    finally:
        await launcher.close()
    await plane.executor.put_generation(_generation("job-a", 1), None)
    await plane.executor.put_generation(_generation("job-b", 1), None)

    agent = await Bus.connect(servers.nats.url, "agent-job-a", credentials=cred_a)
    admin = await role_bus(servers, "admin")
    try:
        assert agent.job_id == "job-a"
        assert agent.user == "job.job-a"
        # What the job may do: its own heartbeat and reports, and read its own generation.
        heard: list[bytes] = []
        sub = await admin.nc.subscribe(Subjects.heartbeat("job-a"), cb=_collect(heard))
        await admin.confirm()
        beat = Heartbeat(
            event_id="hb-1",
            source="job-a-w0",
            job_id="job-a",
            member_id="job-a-w0",
            rank=0,
            generation=1,
            step=1,
            node="n0",
            gpu=0,
            pid=1,
        )
        await agent.publish_core(Subjects.heartbeat("job-a"), beat)
        ack = await agent.publish(_report("job-a", "own"), Subjects.agent_report("job-a"))
        assert ack.seq > 0
        found = await agent.get_generation("job-a")
        assert found is not None
        assert found[0].generation == 1
        await _wait(lambda: heard, "the job's own heartbeat")
        await sub.unsubscribe()

        caplog.set_level(logging.ERROR, logger="torchrelay.bus")
        # Cannot publish a fault (only the detector may).
        fault = FaultDetected(
            event_id=make_event_id("forged", "job-a"),
            source="job-a-w0",
            fault_id="forged",
            kind=FaultKind.GPU_LOST,
            severity=Severity.FATAL,
            action=FaultAction.MIGRATE_NOW,
            job_id="job-a",
            cluster="local",
            node="n0",
            gpu=0,
            evidence={"detail": "forged by a job"},
        )
        with pytest.raises(PermissionRefused, match=r"tr\.evt\.fault\.detected.*job\.job-a"):
            await agent.publish(fault, Subjects.FAULT_DETECTED, timeout=0.5, retry_for=5.0)
        assert any(
            "tr.evt.fault.detected" in r.getMessage() and "job.job-a" in r.getMessage()
            for r in caplog.records
        ), "the refusal is logged naming subject and user"

        # Cannot write any generation, its own included.
        for key in ("job-a", "job-b", "job-c"):
            subject = f"$KV.tr_generations.{key}"
            await agent.nc.publish(subject, _generation(key, 99).model_dump_json().encode())
            await agent.confirm()
            await refused(agent, subject)
        for key in ("job-a", "job-b"):
            got = await plane.executor.get_generation(key)
            assert got is not None
            assert got[0].generation == 1, "a generation was overwritten"

        # Cannot read another job's generation (neither direct get nor its KV subject).
        with pytest.raises(PermissionRefused):
            await agent.request(generation_direct_get("job-b"), {}, timeout=1.0)
        await agent.nc.subscribe("$KV.tr_generations.job-b", cb=_collect([]))
        await agent.confirm()
        await refused(agent, "$KV.tr_generations.job-b")
        await agent.nc.subscribe("tr.evt.>", cb=_collect([]))
        await agent.confirm()
        await refused(agent, "tr.evt.>")

        # Cannot publish on another job's subjects.
        with pytest.raises(PermissionRefused, match=r"tr\.evt\.report\.job-b"):
            await agent.publish(
                _report("job-b", "forged"), Subjects.agent_report("job-b"), timeout=0.5
            )
        await agent.publish_core(Subjects.heartbeat("job-b"), beat)
        await agent.confirm()
        await refused(agent, Subjects.heartbeat("job-b"))
        # Nor ask the control plane anything.
        with pytest.raises(PermissionRefused):
            await agent.request(Subjects.rpc("scheduler", "job_credentials"), {}, timeout=1.0)

        # Nothing forged reached the stream.
        js = admin.js
        for subject in (Subjects.FAULT_DETECTED, Subjects.agent_report("job-b")):
            with pytest.raises(nats.js.errors.NotFoundError):
                await js.get_last_msg("TR_EVENTS", subject)
    finally:
        await agent.close()
        await admin.close()


async def test_generation_put_reaches_the_job_live(
    servers: Servers, plane: Plane, tmp_path: Path
) -> None:
    launcher = await role_bus(servers, "launcher")
    try:
        cred = await _job_credential(servers, launcher, "job-live", tmp_path)
    finally:
        await launcher.close()
    agent = await Bus.connect(servers.nats.url, "agent-live", credentials=cred)
    try:
        seen: list[bytes] = []
        await agent.nc.subscribe("$KV.tr_generations.job-live", cb=_collect(seen))
        await agent.confirm()  # the server has the subscription before the first put
        revision = await plane.executor.put_generation(_generation("job-live", 1), None)
        await plane.executor.put_generation(_generation("job-live", 2), revision)
        await _wait(lambda: len(seen) >= 2, "both puts seen live by the job")
        assert Generation.model_validate_json(seen[-1]).generation == 2
        found = await agent.get_generation("job-live")
        assert found is not None
        assert found[0].generation == 2
        assert found[1] > revision
        assert not agent.refusals
    finally:
        await agent.close()


async def test_expired_revoked_and_unknown_job_credentials_are_refused_at_connect(
    servers: Servers, plane: Plane, tmp_path: Path
) -> None:
    user, password, _ = await plane.store.mint("job-short", "acme", CLAIM, ttl_s=1.0)
    short = tmp_path / "short.cred"
    short.write_text(f"{user}:{password}\n")
    agent = await Bus.connect(servers.nats.url, "agent-short", credentials=str(short))
    await agent.close()
    await asyncio.sleep(1.3)
    with pytest.raises(BusError, match=r"refused user job\.job-short"):
        await Bus.connect(servers.nats.url, "agent-short", credentials=str(short), timeout=3)

    user, password, _ = await plane.store.mint("job-revoked", "acme", CLAIM)
    revoked = tmp_path / "revoked.cred"
    revoked.write_text(f"{user}:{password}\n")
    launcher = await role_bus(servers, "launcher")
    try:
        got = await launcher.request(
            Subjects.rpc("scheduler", "job_credentials_revoke"),
            {"job_id": "job-revoked", "claim": CLAIM},
        )
        assert got["revoked"] is True
    finally:
        await launcher.close()
    with pytest.raises(BusError, match="refused"):
        await Bus.connect(servers.nats.url, "agent-revoked", credentials=str(revoked), timeout=3)

    wrong = tmp_path / "wrong.cred"
    wrong.write_text("job.job-a:not-the-password\n")
    with pytest.raises(BusError, match="refused"):
        await Bus.connect(servers.nats.url, "agent-wrong", credentials=str(wrong), timeout=3)
    with pytest.raises(BusError, match="refused"):
        await Bus.connect(servers.nats.url, "anonymous", timeout=3)


async def test_a_live_job_connection_outlives_the_callout_and_reconnects(
    servers: Servers, plane: Plane, tmp_path: Path
) -> None:
    """The user JWT has no expiry of its own (nats-py would close, not reconnect, a
    connection whose JWT expires); after the server restarts, the job reconnects through
    the callout while its credential is live."""
    user, password, _ = await plane.store.mint("job-long", "acme", CLAIM, ttl_s=3600.0)
    path = tmp_path / "long.cred"
    path.write_text(f"{user}:{password}\n")
    agent = await Bus.connect(servers.nats.url, "agent-long", credentials=str(path))
    try:
        await asyncio.sleep(1.0)
        assert agent.nc.is_connected
        servers.nats.stop()
        servers.nats.start()
        # The job may reconnect before the scheduler's callout is back: refused, it retries.
        deadline = time.monotonic() + 30.0
        while True:
            try:
                await agent.nc.flush(timeout=1)
                break
            except (nats.errors.Error, TimeoutError):
                assert time.monotonic() < deadline, "the job did not reconnect"
                assert not agent.nc.is_closed, "the job's connection was closed for good"
                await asyncio.sleep(0.2)
        agent.refusals.clear()
        beat = Heartbeat(
            event_id="hb-long",
            source="job-long-w0",
            job_id="job-long",
            member_id="job-long-w0",
            generation=0,
            step=1,
            node="n0",
            gpu=0,
            pid=1,
        )
        await agent.publish_core(Subjects.heartbeat("job-long"), beat)
        await agent.confirm()
        assert not agent.refusals
    finally:
        await agent.close()


async def test_service_credentials_can_do_their_work_and_nothing_else(
    servers: Servers, plane: Plane
) -> None:
    detector = await role_bus(servers, "detector")
    launcher = await role_bus(servers, "launcher")
    try:
        fault = FaultDetected(
            event_id=make_event_id("real-fault", time.time()),
            source="detector",
            fault_id="f-real",
            kind=FaultKind.GPU_LOST,
            severity=Severity.FATAL,
            action=FaultAction.MIGRATE_NOW,
            job_id="job-svc",
            cluster="local",
            node="n0",
            gpu=0,
            evidence={"xid": 79},
        )
        ack = await detector.publish(fault, Subjects.FAULT_DETECTED)
        assert ack.seq > 0
        # The executor writes generations; the detector and the launcher may not.
        await plane.executor.put_generation(_generation("job-svc", 1), None)
        for bus in (detector, launcher):
            await bus.nc.publish("$KV.tr_generations.job-svc", b"{}")
            await bus.confirm()
            await refused(bus, "$KV.tr_generations.job-svc")
        # The launcher reads generations, registers jobs, but may not publish a fault.
        found = await launcher.get_generation("job-svc")
        assert found is not None
        assert found[0].generation == 1
        with pytest.raises(PermissionRefused):
            await launcher.publish(fault, Subjects.FAULT_DETECTED, timeout=0.5)
        # The operator's CLI and the API may not mint job credentials.
        operator = await role_bus(servers, "operator")
        try:
            with pytest.raises(PermissionRefused):
                await operator.request(
                    Subjects.rpc("scheduler", "job_credentials"),
                    {"job_id": "x", "tenant": "acme"},
                    timeout=1.0,
                )
        finally:
            await operator.close()
    finally:
        await detector.close()
        await launcher.close()


async def test_redis_users_are_limited_to_their_service_prefix(servers: Servers) -> None:
    port = servers.redis.port
    billing = aioredis.from_url(servers.bundle.redis_url("127.0.0.1", port, role="billing"))
    anonymous = aioredis.from_url(f"redis://127.0.0.1:{port}/0")
    try:
        await billing.set("tr:billing:probe", b"1")
        assert await billing.get("tr:billing:probe") == b"1"
        with pytest.raises(redis.exceptions.NoPermissionError):
            await billing.get("tr:scheduler:jobcred:job.job-a")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await billing.flushall()
        with pytest.raises(redis.exceptions.AuthenticationError):
            await anonymous.get("tr:billing:probe")
    finally:
        await billing.aclose()
        await anonymous.aclose()


def test_generated_files_are_private_and_stable(servers: Servers) -> None:
    directory = servers.bundle.directory
    for path in directory.rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    again = ensure_bundle(directory)
    assert again.passwords == servers.bundle.passwords
    assert again.issuer.public == servers.bundle.issuer.public


def _collect(into: list[bytes]) -> Any:
    async def _cb(msg: Any) -> None:
        into.append(msg.data)

    return _cb


async def _ignore(_exc: Exception) -> None:
    return None


async def _wait(predicate: Any, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
async def test_tls_settings_reach_the_nats_connection(tmp_path: Path) -> None:
    """TORCHRELAY_NATS_TLS_CA: the bus verifies a TLS-only server against the CA given;
    without it the handshake fails (a self-signed certificate)."""
    key, cert = tmp_path / "server.key", tmp_path / "server.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    tls = f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n}}'
    server = nats_server(tmp_path, extra_config=tls)
    server.start()
    try:
        url = server.url.replace("nats://", "tls://")
        bus = await Bus.connect(url, "tls-test", tls=TlsFiles(ca=str(cert)), timeout=5)
        try:
            await bus.confirm()
            assert bus.nc.is_connected
        finally:
            await bus.close()
        with pytest.raises(BusError):
            await Bus.connect(url, "tls-untrusted", tls=TlsFiles(), timeout=2)
    finally:
        server.stop()
