"""The bus probed as an attacker would, with every credential of an embedded stack but
``admin``: each administrative or forging path is refused by the NATS server, while
``admin`` (the provisioning identity) can take the same path (so each check can fail).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import pytest
from nats.js.api import RePublish, StreamConfig

from torchrelay.auth import ADMIN, REVOKER, ROLES, kick_user
from torchrelay.bus import Bus, BusError, RpcFailed
from torchrelay.contract import CONSUMERS, Subjects

from .authstack import CLAIM, Plane, Servers, plane, refused, role_bus, servers

__all__ = ["plane", "servers"]  # fixtures

EVENTS = "TR_EVENTS"
KV = "KV_tr_generations"


def _admin_paths(role: str) -> list[tuple[str, bytes]]:
    """JetStream administration (and reads/acks of other roles' work) as raw API requests."""
    republish = {
        "name": f"EVIL_{role.upper()}",
        "subjects": [f"evil.{role}"],
        "republish": {"src": ">", "dest": "$KV.tr_generations.victim"},
        "storage": "memory",
    }
    mirror = {"name": f"EVIL_M_{role.upper()}", "mirror": {"name": EVENTS}, "storage": "memory"}
    sourced = {
        "name": f"EVIL_S_{role.upper()}",
        "sources": [{"name": EVENTS}],
        "subjects": ["tr.evt.fault.detected"],
        "storage": "memory",
    }
    push = {
        "stream_name": EVENTS,
        "config": {"deliver_subject": Subjects.FAULT_DETECTED, "ack_policy": "none"},
    }
    other = "billing" if role != "billing" else "scheduler"
    stolen = next(spec.durable for spec in CONSUMERS.values() if spec.service == other)
    return [
        (f"$JS.API.STREAM.CREATE.{republish['name']}", json.dumps(republish).encode()),
        (f"$JS.API.STREAM.CREATE.{mirror['name']}", json.dumps(mirror).encode()),
        (f"$JS.API.STREAM.CREATE.{sourced['name']}", json.dumps(sourced).encode()),
        (f"$JS.API.STREAM.UPDATE.{EVENTS}", json.dumps({"name": EVENTS}).encode()),
        (f"$JS.API.STREAM.DELETE.{EVENTS}", b""),
        (f"$JS.API.STREAM.PURGE.{EVENTS}", json.dumps({"filter": "tr.evt.>"}).encode()),
        (f"$JS.API.STREAM.MSG.DELETE.{EVENTS}", json.dumps({"seq": 1}).encode()),
        (f"$JS.API.STREAM.MSG.GET.{EVENTS}", json.dumps({"seq": 1}).encode()),
        (f"$JS.API.DIRECT.GET.{EVENTS}", json.dumps({"seq": 1}).encode()),
        (f"$JS.API.STREAM.PURGE.{KV}", b""),
        (f"$JS.API.STREAM.MSG.DELETE.{KV}", json.dumps({"seq": 1}).encode()),
        (f"$JS.API.STREAM.UPDATE.{KV}", b"{}"),
        (f"$JS.API.CONSUMER.CREATE.{EVENTS}", json.dumps(push).encode()),
        (f"$JS.API.CONSUMER.CREATE.{EVENTS}.evil.tr.evt.>", json.dumps(push).encode()),
        (f"$JS.API.CONSUMER.DURABLE.CREATE.{EVENTS}.{stolen}", json.dumps(push).encode()),
        (f"$JS.API.CONSUMER.DELETE.{EVENTS}.{stolen}", b""),
        (f"$JS.API.CONSUMER.MSG.NEXT.{EVENTS}.{stolen}", b'{"batch":1}'),
        (f"$JS.ACK.{EVENTS}.{stolen}.1.1.1.1.0", b"+ACK"),
        ("$JS.API.STREAM.SNAPSHOT.TR_EVENTS", b"{}"),
        ("$KV.tr_generations.victim", b"{}"),
        (Subjects.FAULT_DETECTED, b"{}"),
    ]


def _allowed_own_work(role: str) -> set[str]:
    """Subjects of :func:`_admin_paths` that are the role's own work (not a back door)."""
    own = {Subjects.FAULT_DETECTED} if role == "detector" else set()
    if role == "migration_executor":
        own.add("$KV.tr_generations.victim")
    return own


@pytest.mark.parametrize("role", list(ROLES))
async def test_no_runtime_role_administers_jetstream(
    servers: Servers, plane: Plane, role: str
) -> None:
    bus = await role_bus(servers, role)
    try:
        own = _allowed_own_work(role)
        paths = [(s, b) for s, b in _admin_paths(role) if s not in own]
        for subject, body in paths:
            await bus.nc.publish(subject, body, reply=bus.nc.new_inbox())
        await bus.confirm()
        for subject, _ in paths:
            await refused(bus, subject)
    finally:
        await bus.close()


async def test_a_republish_stream_cannot_forge_a_generation_or_a_fault(
    servers: Servers, plane: Plane
) -> None:
    """The finding reproduced through nats-py's API: refused for the launcher, and nothing
    reaches the bucket or the event stream; ``admin`` may create a (harmless) stream."""
    launcher = await role_bus(servers, "launcher")
    admin = await role_bus(servers, ADMIN)
    try:
        before = await admin.js.stream_info(EVENTS)
        for dest in ("$KV.tr_generations.forged", Subjects.FAULT_DETECTED):
            cfg = StreamConfig(
                name="FORGE",
                subjects=[Subjects.agent_report("forge")],
                republish=RePublish(src=">", dest=dest),
            )
            with pytest.raises((nats.errors.TimeoutError, TimeoutError, nats.js.errors.Error)):
                await launcher.nc.jetstream(timeout=1.0).add_stream(cfg)
            assert launcher.refused("$JS.API.STREAM.CREATE.FORGE")
        with pytest.raises(nats.js.errors.NotFoundError):
            await admin.js.stream_info("FORGE")
        assert await launcher.get_generation("forged") is None
        after = await admin.js.stream_info(EVENTS)
        assert after.state.messages == before.state.messages
        # The same call works for the provisioning identity: the refusal above is a
        # permission, not a broken request.
        await admin.js.add_stream(StreamConfig(name="HARMLESS", subjects=["harmless.>"]))
        await admin.js.delete_stream("HARMLESS")
    finally:
        await launcher.close()
        await admin.close()


@pytest.mark.parametrize("role", ["api", "operator", "billing", "detector"])
async def test_no_role_reads_another_roles_replies(servers: Servers, role: str) -> None:
    bus = await role_bus(servers, role)
    try:
        for subject in ("_INBOX.>", "_RINBOX.launcher.>", "_RINBOX.>", "_INBOX_job-a.>"):
            await bus.nc.subscribe(subject)
            await bus.confirm()
            await refused(bus, subject)
    finally:
        await bus.close()


async def test_runtime_roles_cannot_create_what_admin_did_not_provision(
    servers: Servers, plane: Plane
) -> None:
    """A service started before provisioning is told how to fix it, not given a way in."""
    billing = await role_bus(servers, "billing")
    try:
        spec = CONSUMERS["billing"].model_copy(update={"durable": "billing-missing"})
        with pytest.raises(BusError, match="torchrelay provision"):
            await billing.ensure_consumer(spec)
    finally:
        await billing.close()


async def _mint(bus: Bus, job_id: str, tenant: str, claim: str) -> dict[str, Any]:
    return await bus.request(
        Subjects.rpc("scheduler", "job_credentials"),
        {"job_id": job_id, "tenant": tenant, "claim": claim},
        timeout=5.0,
    )


async def test_a_launcher_mints_and_revokes_only_its_own_jobs(
    servers: Servers, plane: Plane, tmp_path: Path
) -> None:
    mine = await role_bus(servers, "launcher")
    theirs = await role_bus(servers, "launcher")
    other_claim = "another-launcher-secret-0000"
    try:
        got = await _mint(mine, "job-owned", "acme", CLAIM)
        cred = tmp_path / "owned.cred"
        cred.write_text(f"{got['user']}:{got['password']}\n")
        # Another launcher (same NATS role, other claim) may not mint, replace or revoke it.
        with pytest.raises(RpcFailed, match="another launcher"):
            await _mint(theirs, "job-owned", "acme", other_claim)
        with pytest.raises(RpcFailed, match="tenant"):
            await _mint(mine, "job-owned", "evil-corp", CLAIM)
        with pytest.raises(RpcFailed, match="live credential"):
            await _mint(mine, "job-owned", "acme", CLAIM)
        with pytest.raises(RpcFailed, match="another launcher"):
            await theirs.request(
                Subjects.rpc("scheduler", "job_credentials_revoke"),
                {"job_id": "job-owned", "claim": other_claim},
            )
        with pytest.raises(RpcFailed, match="claim"):
            await theirs.request(
                Subjects.rpc("scheduler", "job_credentials_revoke"), {"job_id": "job-owned"}
            )
        # The credential still works after every refused attempt.
        agent = await Bus.connect(servers.nats.url, "agent-owned", credentials=str(cred))
        await agent.close()
    finally:
        await mine.close()
        await theirs.close()


async def test_revocation_closes_the_jobs_live_connections(
    servers: Servers, plane: Plane, tmp_path: Path
) -> None:
    launcher = await role_bus(servers, "launcher")
    try:
        got = await _mint(launcher, "job-kicked", "acme", CLAIM)
        cred = tmp_path / "kicked.cred"
        cred.write_text(f"{got['user']}:{got['password']}\n")
        agent = await Bus.connect(servers.nats.url, "agent-kicked", credentials=str(cred))
        other = await _mint(launcher, "job-stays", "acme", CLAIM)
        cred2 = tmp_path / "stays.cred"
        cred2.write_text(f"{other['user']}:{other['password']}\n")
        bystander = await Bus.connect(servers.nats.url, "agent-stays", credentials=str(cred2))
        try:
            assert agent.nc.is_connected
            reply = await launcher.request(
                Subjects.rpc("scheduler", "job_credentials_revoke"),
                {"job_id": "job-kicked", "claim": CLAIM},
            )
            assert reply["revoked"] is True
            # Kicked, and every reconnect is refused at the callout.
            deadline = time.monotonic() + 5.0
            while agent.nc.is_connected and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not agent.nc.is_connected
            await asyncio.sleep(1.0)
            assert not agent.nc.is_connected
            assert bystander.nc.is_connected
        finally:
            await agent.close()
            await bystander.close()
    finally:
        await launcher.close()


async def test_the_revoker_can_only_list_and_kick(servers: Servers) -> None:
    revoker = await role_bus(servers, REVOKER)
    try:
        assert await kick_user(revoker.nc, "job.nobody") == 0
        for subject in ("$SYS.REQ.SERVER.PING.STATSZ", "$SYS.REQ.ACCOUNT.PING.CONNZ", "tr.rpc.x"):
            await revoker.nc.publish(subject, b"{}", reply=revoker.nc.new_inbox())
            await revoker.confirm()
            await refused(revoker, subject)
    finally:
        await revoker.close()
