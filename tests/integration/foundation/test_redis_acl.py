"""The Redis users ``torchrelay.auth.ensure_bundle`` generates, against a real ``redis-server``
started with that ACL file: each service may run only the commands it uses, on its own key
prefix, and each service's own Redis work goes through as its user.

Every refusal asserted here comes from the server. After a service's work the server's ACL
LOG is read: nothing the service did may have been refused (beyond redis-py's optional
handshake commands, CLIENT SETINFO and CLIENT MAINT_NOTIFICATIONS, whose refusal redis-py
ignores).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from services.api.auth import TokenStore
from services.billing.ledger import Ledger
from services.billing.rules import ContractRequest
from services.detector.rules import DetectorConfig
from services.detector.state import EpisodeStore, JobDirectory, Membership, NodeRegistry
from services.migration_executor import saga
from services.migration_executor.saga import JobTerms
from services.migration_executor.store import ExecutorStore
from services.scheduler.incidents import IncidentStore
from services.scheduler.registry import JobRegistry
from services.spare_pool.inventory import SpareInventory
from services.spare_pool.rules import ReserveRequest
from torchrelay.auth import SERVICE_ROLES, AuthBundle, JobCredentialStore, ensure_bundle
from torchrelay.bus import RedisDeduper
from torchrelay.contract import (
    AgentReport,
    FaultKind,
    GenerationChanged,
    Incident,
    JobPolicy,
    JobRegistered,
    Member,
    MigrationMode,
    MigrationRequested,
    NodeHealth,
    RankAssignment,
    ReportKind,
    Resolution,
    Role,
    Severity,
    SpareSlot,
    SpareState,
    make_event_id,
)
from torchrelay.redis_acl import redis_commands as allowed_commands
from torchrelay.runtime import ServerProcess, redis_server

# redis-py's connection handshake: refused, and the refusal is ignored by redis-py.
HANDSHAKE = {"client"}


@dataclass
class AclRedis:
    bundle: AuthBundle
    server: ServerProcess

    def url(self, role: str | None = None) -> str:
        return self.bundle.redis_url("127.0.0.1", self.server.port, role=role)


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    state = tmp_path_factory.mktemp("redis-acl")
    bundle = ensure_bundle(state / "auth")
    server = redis_server(state, password=bundle.redis_password, aclfile=bundle.redis_acl_path)
    server.start()
    try:
        yield AclRedis(bundle, server)
    finally:
        server.stop()


@pytest.fixture
async def admin(acl_redis: AclRedis) -> AsyncIterator[aioredis.Redis]:
    """The ``default`` user (probes, recovery): the ACL LOG is cleared for each test."""
    client = aioredis.from_url(acl_redis.url())
    await client.execute_command("ACL", "LOG", "RESET")
    yield client
    await client.aclose()


async def as_role(acl_redis: AclRedis, role: str) -> aioredis.Redis:
    return aioredis.from_url(acl_redis.url(role))


async def refusals(admin: aioredis.Redis, role: str) -> list[tuple[str, str, str]]:
    """What the server refused ``role`` since the test began, less the handshake's."""
    log = await admin.execute_command("ACL", "LOG")
    rows = []
    for entry in log:
        e = {_text(k): _text(v) for k, v in entry.items()}
        if e["username"] == role and not (e["reason"] == "command" and e["object"] in HANDSHAKE):
            rows.append((e["reason"], e["context"], e["object"]))
    return rows


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _is_refusal(exc: BaseException) -> bool:
    """NOPERM: at the top level (NoPermissionError), or of a command a script calls."""
    text = str(exc)
    return isinstance(exc, redis.exceptions.NoPermissionError) or (
        isinstance(exc, redis.exceptions.ResponseError)
        and ("NOPERM" in text or "can't run this command" in text or "can't access" in text)
    )


async def assert_refused(client: aioredis.Redis, *args: Any) -> None:
    with pytest.raises(redis.exceptions.ResponseError) as refused:
        await client.execute_command(*args)
    assert _is_refusal(refused.value), f"{args}: {refused.value!r} is not a permission refusal"


# ----------------------------------------------------------------- the table and the file


def test_every_service_user_is_an_allow_list_on_its_own_prefix(acl_redis: AclRedis) -> None:
    lines = {line.split()[1]: line for line in acl_redis.bundle.redis_acl().splitlines()}
    assert lines["default"].endswith("~* &* +@all")
    for role in SERVICE_ROLES:
        rules = lines[role].split()
        start = rules.index("resetkeys")
        # Keys, channels, commands; the password comes before and is not shown here.
        assert rules[start:] == [
            "resetkeys",
            f"~tr:{role}:*",
            f"~tr:{role}",
            "resetchannels",
            "-@all",
            *(f"+{c}" for c in allowed_commands(role)),
        ]


async def test_the_command_table_names_only_commands_the_server_has(
    acl_redis: AclRedis, admin: aioredis.Redis
) -> None:
    names = {c.split("|")[0] for role in SERVICE_ROLES for c in allowed_commands(role)}
    for name in sorted(names):
        info = await admin.execute_command("COMMAND INFO", name)
        assert info, f"{name} is not a command of this server"
        assert info[0] is not None, f"{name} is not a command of this server"
    # The server loaded the file: each user has its prefix only, no channel, and starts from
    # no command (the server words the commands its own way; what they allow is tested below).
    for role in SERVICE_ROLES:
        user = await admin.execute_command("ACL", "GETUSER", role)
        if not isinstance(user, dict):  # RESP2: a flat list of pairs
            user = dict(zip(user[::2], user[1::2], strict=True))
        fields = {_text(k): v for k, v in user.items()}
        assert _text(fields["commands"]).startswith("-@all "), role
        assert [_text(k) for k in fields["keys"]] == [f"tr:{role}:*", f"tr:{role}"]
        assert list(fields["channels"]) == []


# --------------------------------------------------------------------- what is refused

# What no service may run, whatever its table says (MONITOR is left out: it never returns).
REFUSED: list[tuple[str, ...]] = [
    ("SWAPDB", "0", "1"),
    ("REPLICAOF", "127.0.0.1", "1"),
    ("SLAVEOF", "NO", "ONE"),
    ("CLIENT", "PAUSE", "1"),
    ("CLIENT", "KILL", "ID", "999999"),
    ("CLIENT", "LIST"),
    ("SAVE",),
    ("BGSAVE",),
    ("BGREWRITEAOF",),
    ("SELECT", "1"),
    ("SELECT", "0"),
    ("KEYS", "*"),
    ("RANDOMKEY",),
    ("DBSIZE",),
    ("INFO",),
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("CONFIG", "GET", "*"),
    ("CONFIG", "SET", "appendfsync", "no"),
    ("CONFIG", "REWRITE"),
    ("ACL", "LIST"),
    ("DEBUG", "SLEEP", "0"),
    ("MODULE", "LIST"),
    ("PUBLISH", "tr.evt.x", "x"),
    ("SCRIPT", "FLUSH"),
    ("SCRIPT", "KILL"),
    ("SHUTDOWN", "NOSAVE"),
]


@pytest.mark.parametrize("role", SERVICE_ROLES)
async def test_a_service_user_is_refused_what_it_does_not_use(
    acl_redis: AclRedis, admin: aioredis.Redis, role: str
) -> None:
    client = await as_role(acl_redis, role)
    other = next(r for r in SERVICE_ROLES if r != role)
    try:
        # Allowed: its own prefix.
        await client.set(f"tr:{role}:probe", b"1")
        assert await client.get(f"tr:{role}:probe") == b"1"
        for args in REFUSED:
            await assert_refused(client, *args)
        own = f"tr:{role}:probe"
        await assert_refused(client, "MIGRATE", "127.0.0.1", "1", own, "0", "100")
        await assert_refused(client, "RENAME", own, f"tr:{other}:stolen")
        await assert_refused(client, "SCAN", "0")
        # Another service's keys, and a prefix that only starts like its own.
        for key in (f"tr:{other}:probe", f"tr:{other}", f"tr:{role}x:probe", "probe"):
            await assert_refused(client, "GET", key)
            await assert_refused(client, "SET", key, "1")
        # A script may not do what its caller may not.
        if "eval" in allowed_commands(role):
            await assert_refused(client, "EVAL", "return redis.call('FLUSHALL')", "0")
            await assert_refused(client, "EVAL", f"return redis.call('GET', 'tr:{other}:x')", "0")
        else:
            await assert_refused(client, "EVAL", "return 1", "0")
        assert await admin.ping()  # SHUTDOWN above did not stop the server
    finally:
        await client.aclose()


# ---------------------------------------------- each service's Redis work, as its user


async def _no_refusals(admin: aioredis.Redis, role: str) -> None:
    assert await refusals(admin, role) == [], f"{role} was refused a command it needs"


def _job(job_id: str) -> JobRegistered:
    return JobRegistered(
        event_id=make_event_id("job", job_id),
        source="test",
        job_id=job_id,
        tenant="acme",
        world_size=2,
        spares=0,
        policy=JobPolicy.WAIT,
        launcher_id="launcher-test",
        members=[
            Member(member_id=f"{job_id}-w{i}", role=Role.WORKER, node="n0", gpu=i, pid=100 + i)
            for i in range(2)
        ],
    )


def _generation(job_id: str, number: int) -> GenerationChanged:
    return GenerationChanged(
        event_id=make_event_id("gen", job_id, number),
        source="test",
        job_id=job_id,
        generation=number,
        previous=number - 1,
        reason="test",
        migration_id=f"m-{number}",
        ranks=[
            RankAssignment(rank=0, member_id=f"{job_id}-w0", node="n0", gpu=0),
            RankAssignment(rank=1, member_id=f"{job_id}-s{number}", node="n1", gpu=0),
        ],
    )


def _incident(incident_id: str, *, resolution: Resolution = Resolution.LOST) -> Incident:
    at = datetime(2025, 2, 1, tzinfo=UTC)
    return Incident(
        incident_id=incident_id,
        tenant="acme",
        job_id="job-1",
        rank=0,
        node="n0",
        gpu=0,
        fault_kind=FaultKind.GPU_LOST,
        severity=Severity.FATAL,
        detected_at=at,
        resolved_at=at,
        resolution=resolution,
        fault_id=f"f-{incident_id}",
    )


async def _dedupe(client: aioredis.Redis, role: str) -> None:
    """What every service does: connect_redis's PING, and RedisDeduper behind its consumer."""
    assert await client.ping()
    deduper = RedisDeduper(client, f"tr:{role}")
    assert not await deduper.seen("e1")
    await deduper.mark("e1")
    assert await deduper.seen("e1")


async def test_the_spare_pool_runs_its_inventory_as_its_user(
    acl_redis: AclRedis, admin: aioredis.Redis
) -> None:
    client = await as_role(acl_redis, "spare_pool")
    try:
        await _dedupe(client, "spare_pool")
        now = [1_800_000_000.0]
        inv = SpareInventory(client, "tr:spare_pool", clock=lambda: now[0], heartbeat_grace_s=30)
        for gpu in range(3):
            await inv.register(
                SpareSlot(
                    slot_id=f"c1:n1:{gpu}",
                    cluster="c1",
                    node="n1",
                    gpu=gpu,
                    gpu_model="H100",
                    memory_mb=80_000,
                    nvlink_domain="nvl-1",
                    rack="r1",
                    zone="z1",
                    state=SpareState.IDLE,
                )
            )
        for gpu, job in enumerate(("j1", "j9")):
            await inv.register(
                SpareSlot(
                    slot_id=f"c1:n2:{gpu}",
                    cluster="c1",
                    node="n2",
                    gpu=gpu,
                    gpu_model="H100",
                    memory_mb=80_000,
                    nvlink_domain="nvl-2",
                    rack="r1",
                    zone="z1",
                    state=SpareState.HOT,
                    job_id=job,
                    member_id=f"{job}-s0",
                )
            )
        first = (
            await inv.reserve(ReserveRequest.model_validate({"job_id": "j1", "cluster": "c1"}))
        ).lease
        assert first is not None
        _, _, error = await inv.confirm(first.lease_id)
        assert error is None
        second = (
            await inv.reserve(ReserveRequest.model_validate({"job_id": "j2", "cluster": "c1"}))
        ).lease
        assert second is not None
        await inv.release(second.lease_id, "done")
        await inv.reserve(
            ReserveRequest.model_validate({"job_id": "j3", "cluster": "c1", "lease_s": 1})
        )
        assert await inv.heartbeat("j9-s0", 5.0)
        now[0] += 60
        await inv.sweep()
        await inv.lapsed_members()
        await inv.tracked_members()
        await inv.set_health("c1", "n1", 2, "unhealthy")
        await inv.exclusion_of((await inv.get_slot("c1:n1:2")).slot)  # type: ignore[union-attr]
        await inv.set_health("c1", "n1", 2, "healthy")
        await inv.quarantine("n1", gpu=1, cluster="c1", reason="xid", rma=False)
        await inv.return_to_service("n1", gpu=1, cluster="c1", reason="fixed")
        await inv.job_finished("j1", "finished")
        await inv.forget_lapsed("j1")
        await inv.forget_lapsed_member("j9-s0")
        await inv.depth("c1")
        # Without a clock the scripts read the server's (TIME).
        await SpareInventory(client, "tr:spare_pool").depth("c1")
        await inv.mark_low("c1", "nvl-1", 1)
        assert await inv.was_low("c1", "nvl-1") == 1
        await inv.clear_low("c1", "nvl-1")
        await inv.list_slots(state="idle")
        await inv.history("c1:n1:0")
        assert await inv.audit() == []
        await _no_refusals(admin, "spare_pool")
    finally:
        await client.aclose()


async def test_billing_runs_its_ledger_as_its_user(
    acl_redis: AclRedis, admin: aioredis.Redis
) -> None:
    client = await as_role(acl_redis, "billing")
    try:
        await _dedupe(client, "billing")
        ledger = Ledger(client, f"tr:billing:{uuid.uuid4().hex[:8]}")
        contract, _ = await ledger.create_contract(
            ContractRequest.model_validate(
                {
                    "tenant": "acme",
                    "term_start": datetime(2025, 1, 1, tzinfo=UTC),
                    "term_end": datetime(2025, 4, 1, tzinfo=UTC),
                    "renewal_fee_minor": 1_000_000,
                    "currency": "USD",
                }
            )
        )
        await ledger.get_contract(contract.contract_id)
        await ledger.list_contracts()
        await ledger.record(_incident("i1"))
        await ledger.record(_incident("i2"))
        # The same incident id with other content: a recorded conflict.
        conflict = _incident("i1").model_copy(update={"gpu": 3})
        assert (await ledger.record(conflict)).outcome == "conflict"
        await ledger.correct(_incident("i2", resolution=Resolution.MIGRATED_LIVE), "late")
        # A restart's lost steps, learnt after the close: an amendment entry.
        await ledger.record(_incident("i3", resolution=Resolution.CHECKPOINT_RESTART))
        later = _incident("i3", resolution=Resolution.CHECKPOINT_RESTART)
        assert (await ledger.amend(later.model_copy(update={"lost_steps": 5}), "r")).outcome == "ok"
        await ledger.guarantee(contract.contract_id)
        closed = await ledger.close_term(contract.contract_id)
        assert closed.credit is not None
        await ledger.mark_published(closed.credit.credit_id)
        await ledger.credit_record(closed.credit.credit_id)
        await ledger.credits()
        assert (await ledger.verify())["ok"]
        await _no_refusals(admin, "billing")
    finally:
        await client.aclose()


async def test_the_scheduler_runs_its_registry_incidents_and_credentials_as_its_user(
    acl_redis: AclRedis, admin: aioredis.Redis
) -> None:
    client = await as_role(acl_redis, "scheduler")
    try:
        await _dedupe(client, "scheduler")
        registry = JobRegistry(client, "tr:scheduler")
        await registry.register(_job("job-1"))
        await registry.apply_generation(_generation("job-1", 1))
        await registry.record_step("job-1", 10)
        await registry.record_step_times("job-1", 1.5, 3)  # goodput's step time
        assert await registry.step_time("job-1") == 0.5
        await registry.record_pids("job-1", {"job-1-w0": 4242})  # WATCH / MULTI / EXEC
        await registry.record_pids("job-1", {"job-1-w0": 4242})  # no change: UNWATCH
        await registry.add_timeline("job-1", datetime.now(UTC), {"what": "test"})
        assert await registry.view("job-1") is not None
        await registry.active_placements()
        await registry.list_ids()
        await registry.generations("job-1")
        await registry.timeline("job-1")
        incidents = IncidentStore(client, "tr:scheduler")
        opening = _incident("s1", resolution=Resolution.OPEN)
        opened, incident_id = await incidents.open(opening, "job-1-w0", {})
        assert opened == "opened"
        await incidents.open_for_member("job-1", "job-1-w0")
        await incidents.set_mode(incident_id, MigrationMode.IMMEDIATE)
        assert await incidents.close(opening.model_copy(update={"resolution": Resolution.LOST}))
        await incidents.query(job_id="job-1")
        creds = JobCredentialStore(client, "tr:scheduler")
        user, password, _ = await creds.mint("job-1", "acme", "claim-0123456789", ttl_s=60)
        assert await creds.check(user, password) is not None
        assert await creds.revoke("job-1", "claim-0123456789")
        await _no_refusals(admin, "scheduler")
    finally:
        await client.aclose()


def _report(job_id: str, member_id: str, kind: ReportKind, generation: int) -> AgentReport:
    return AgentReport(
        event_id=f"{kind}-{member_id}-{generation}",
        source=f"agent:{member_id}",
        job_id=job_id,
        member_id=member_id,
        kind=kind,
        role=Role.WORKER,
        node="n0",
        gpu=0,
        pid=1,
        cluster="c1",
        generation=generation,
        rank=0,
        step=50,
    )


async def test_the_executor_runs_its_store_as_its_user(
    acl_redis: AclRedis, admin: aioredis.Redis
) -> None:
    client = await as_role(acl_redis, "migration_executor")
    try:
        await _dedupe(client, "migration_executor")
        store = ExecutorStore(client, "tr:migration_executor")
        request = MigrationRequested(
            event_id="r-m1",
            source="scheduler",
            migration_id="m1",
            incident_id="i-m1",
            job_id="j1",
            tenant="acme",
            rank=1,
            member_id="j1-w1",
            node="n1",
            gpu=0,
            mode=MigrationMode.IMMEDIATE,
            fault_kind=FaultKind.WORKER_LOST,
            generation_before=1,
        )
        state = saga.start(request, JobTerms(world_size=2), datetime(2026, 1, 1, tzinfo=UTC))
        assert (await store.create(state, request)).created
        await store.save(state)
        assert await store.load("m1") is not None
        await store.take_job_lock("j1", "m2", "m1")
        await store.unlock_job("j1", "m2")
        assert await store.lock_job("j1", "m1")
        await store.job_lock_holder("j1")
        await store.request_escalation("m1")
        await store.escalation_requested("m1")
        await store.step_flags("m1", "j1")
        await store.escalation_done("m1")
        assert await store.once("marker")
        await store.put_job(_job("j1"))
        assert await store.job("j1") is not None
        await store.mark_running("j1")
        await store.add_joined(_report("j1", "j1-w0", ReportKind.JOINED, 2))
        await store.store_addrs("j1", ["j1-w0"])
        await store.workers_joined("j1")
        await store.joined("j1")
        await store.has_joined("j1", "j1-w0")
        await store.add_resumed(_report("j1", "j1-w0", ReportKind.RESUMED, 2))
        await store.resumed("j1", 2)
        await store.active()
        await store.of_job("j1")
        await store.all_ids()
        await store.finish(state)
        await store.mark_finished("j1", "succeeded", seq=3)
        await store.finished_seq("j1")
        assert await store.finished("j1")
        await store.forget_reports("j1")
        await _no_refusals(admin, "migration_executor")
    finally:
        await client.aclose()


async def test_the_detector_runs_its_state_as_its_user(
    acl_redis: AclRedis, admin: aioredis.Redis
) -> None:
    client = await as_role(acl_redis, "detector")
    try:
        await _dedupe(client, "detector")
        prefix = "tr:detector"
        cfg = DetectorConfig()
        episodes = EpisodeStore(client, prefix, cfg)
        index = f"{prefix}:episodes:n0"
        await episodes.open(f"{prefix}:ep:1", 1.0, node_index=index)
        await episodes.open_and_get(f"{prefix}:ep:2", 1.0, also=f"{prefix}:other")
        await episodes.sync(f"{prefix}:ep:1", node_index=index)
        await episodes.close_node(index)
        jobs = JobDirectory(client, prefix)
        await jobs.register(_job("j1"))
        await jobs.add_member("j1", "j1-s1", "n1", 0, "spare", "local")
        await jobs.set_generation(_generation("j1", 1))
        await jobs.slot_holder("local", "n0", 0)
        await jobs.note_slot_fault("local", "n0", 0, "f1", "gpu_lost")
        await jobs.slot_fault("local", "n0", 0)
        await jobs.ranks_and_cluster("j1")
        await jobs.rank_of("j1", "j1-w0")
        await jobs.mark_exited("j1", "j1-w0")
        await jobs.exited("j1", "j1-w0")
        await jobs.exit_context("j1")
        await jobs.mark_app_error("j1")
        await jobs.app_error("j1")
        await jobs.finish("j1")
        await jobs.finished("j1")
        nodes = NodeRegistry(client, prefix, cfg)
        await nodes.record_inventory("local", {"n0": {"gpus": 8}, "n1": {"gpus": 8}})
        await nodes.clusters()
        await nodes.find_cluster("n0")
        await nodes.inventory("local")
        await nodes.raise_health("local", "n0", NodeHealth.DEGRADED)
        await nodes.raise_health("local", "n1", NodeHealth.UNHEALTHY)  # the breaker's count
        await nodes.health_all("local")
        await nodes.set_health("local", "n0", NodeHealth.HEALTHY)
        await nodes.mark_gpu("local", "n0", 0, NodeHealth.UNHEALTHY, "gpu_lost")
        await nodes.gpu_health("local", "n0")
        await nodes.clear_gpus("local", "n0")
        await nodes.add_lemon("local", "n0", 1.0, 1.0)
        await nodes.lemon("local", "n0", 2.0)
        membership = Membership(client, prefix, "replica-1")
        assert await membership.beat() is not None
        await membership.leave()
        await _no_refusals(admin, "detector")
    finally:
        await client.aclose()


async def test_the_api_runs_its_token_store_as_its_user(
    acl_redis: AclRedis, admin: aioredis.Redis
) -> None:
    client = await as_role(acl_redis, "api")
    try:
        assert await client.ping()
        tokens = await TokenStore.open(client, None, cache_s=0)
        token, principal = await tokens.issue("tenant", "acme")
        assert await tokens.authenticate(token) == principal
        assert [row["token_id"] for row in await tokens.listed()] == [principal.token_id]
        assert await tokens.revoke(principal.token_id)
        assert await tokens.authenticate(token) is None
        await _no_refusals(admin, "api")
    finally:
        await client.aclose()
