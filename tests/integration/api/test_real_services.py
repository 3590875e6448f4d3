"""The API in front of the real scheduler, billing, spare-pool and detector services.

The services run in-process (``serve_service``) on their own event loop, on real NATS and
Redis started for this module; the API is a real uvicorn server. Data is made the way it is
in production: contracts and spares through the API, jobs and faults as events on the bus,
nodes as telemetry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.api.app import create_app
from services.api.settings import ApiSettings
from tests.unit.api.canned import OPERATOR_TOKEN, BackgroundLoop, ServerThread
from tests.unit.api.expect import (
    CONTRACT,
    GUARANTEE,
    INCIDENT,
    JOB,
    NODE,
    RANK,
    SPARE,
    elements_by_testid,
    expected_figures,
    shown_figures,
)
from torchrelay.bus import Bus
from torchrelay.contract import (
    FaultAction,
    FaultDetected,
    FaultKind,
    JobRegistered,
    Member,
    Role,
    Severity,
    Subjects,
    TelemetryBatch,
    TelemetrySample,
    make_event_id,
)
from torchrelay.runtime import nats_server, redis_server
from torchrelay.service import serve_service
from torchrelay.settings import ServiceSettings

pytestmark = pytest.mark.slow


class Stack:
    """Real services + API; ``op``/``acme``/``globex`` are authenticated HTTP clients."""

    def __init__(
        self,
        loop: BackgroundLoop,
        nats_url: str,
        url: str,
        op: httpx.Client,
        acme: httpx.Client,
        globex: httpx.Client,
    ) -> None:
        self.loop, self.nats_url = loop, nats_url
        self.url, self.op, self.acme, self.globex = url, op, acme, globex


def _wait(what: str, probe: Callable[[], bool], deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if probe():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} did not happen within {deadline_s:.0f}s")


async def _publish_world(nats_url: str) -> None:
    bus = await Bus.connect(nats_url, "test-world")
    try:
        for job_id, tenant, node in (("job-a", "acme", "node-1"), ("job-b", "globex", "node-2")):
            await bus.publish(
                JobRegistered(
                    event_id=make_event_id("reg", job_id),
                    source="test",
                    job_id=job_id,
                    tenant=tenant,
                    world_size=2,
                    spares=1,
                    launcher_id=f"l-{job_id}",
                    members=[
                        Member(member_id=f"{job_id}-m{i}", role=Role.WORKER, node=node, gpu=i)
                        for i in range(2)
                    ],
                ),
                Subjects.JOB_REGISTERED,
            )
        for node in ("node-1", "node-2"):
            await bus.publish_core(
                Subjects.telemetry("local", node),
                TelemetryBatch(
                    event_id=make_event_id("tel", node),
                    source="test",
                    cluster="local",
                    node=node,
                    samples=[
                        TelemetrySample(cluster="local", node=node, gpu=g, gpu_model="sim")
                        for g in range(2)
                    ],
                ),
            )
        await bus.confirm()
    finally:
        await bus.close()


async def _publish_faults(nats_url: str) -> None:
    bus = await Bus.connect(nats_url, "test-faults")
    try:
        for job_id, node in (("job-a", "node-1"), ("job-b", "node-2")):
            await bus.publish(
                FaultDetected(
                    event_id=make_event_id("fault", job_id),
                    source="test",
                    fault_id=f"f-{job_id}",
                    cluster="local",
                    node=node,
                    gpu=0,
                    job_id=job_id,
                    rank=0,
                    member_id=f"{job_id}-m0",
                    kind=FaultKind.WORKER_LOST,
                    severity=Severity.FATAL,
                    action=FaultAction.MIGRATE_NOW,
                ),
                Subjects.FAULT_DETECTED,
            )
    finally:
        await bus.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from services.billing.service import setup as billing_setup
    from services.detector.service import DetectorSettings
    from services.detector.service import setup as detector_setup
    from services.scheduler.service import setup as scheduler_setup
    from services.spare_pool.service import setup as spare_pool_setup

    root: Path = tmp_path_factory.mktemp("api-stack")
    nats, redis = nats_server(root / "nats"), redis_server(root / "redis")
    nats.start()
    redis.start()
    loop = BackgroundLoop()
    stop = asyncio.Event()
    common: dict[str, Any] = {
        "nats_url": nats.url,
        "redis_url": redis.url,
        "log_json": False,
        "environment": "test",
        "log_level": "WARNING",
    }
    tasks = []
    for name, setup, cfg in (
        ("scheduler", scheduler_setup, ServiceSettings(**common)),
        ("billing", billing_setup, ServiceSettings(**common)),
        ("spare_pool", spare_pool_setup, ServiceSettings(**common)),
        ("detector", detector_setup, DetectorSettings(**common, detector_inventory_interval_s=0.2)),
    ):
        tasks.append(
            asyncio.run_coroutine_threadsafe(serve_service(name, setup, cfg, stop=stop), loop.loop)
        )
    api_cfg = ApiSettings(**common, operator_token=OPERATOR_TOKEN, rpc_timeout_s=5.0)
    server = ServerThread(loop, create_app(api_cfg))
    url = server.start()
    op = httpx.Client(
        base_url=url, timeout=10, headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    )
    _wait(
        "every service answers",
        lambda: all(
            op.get(p).status_code == 200
            for p in ("/v1/jobs", "/v1/contracts", "/v1/spares", "/v1/nodes")
        ),
    )
    tokens = {
        t: op.post("/v1/tokens", json={"scope": "tenant", "tenant": t}).json()["token"]
        for t in ("acme", "globex")
    }
    clients = {
        t: httpx.Client(base_url=url, timeout=10, headers={"Authorization": f"Bearer {tok}"})
        for t, tok in tokens.items()
    }
    try:
        yield Stack(loop, nats.url, url, op, clients["acme"], clients["globex"])
    finally:
        for c in (op, *clients.values()):
            c.close()
        server.stop()
        loop.loop.call_soon_threadsafe(stop.set)
        for task in tasks:
            task.result(30)
        loop.close()
        nats.stop()
        redis.stop()


@pytest.fixture(scope="module")
def world(stack: Stack) -> Stack:
    """Contracts, spares, jobs, incidents and nodes, made through the real services."""
    op = stack.op
    for cid, tenant, start, end in (
        ("ctr-a", "acme", "2026-01-01T00:00:00Z", "2099-01-01T00:00:00Z"),
        ("ctr-b", "globex", "2025-01-01T00:00:00Z", "2099-01-01T00:00:00Z"),
    ):
        r = op.post(
            "/v1/contracts",
            json={
                "contract_id": cid,
                "tenant": tenant,
                "term_start": start,
                "term_end": end,
                "renewal_fee_minor": 1_000_000,
                "currency": "USD",
            },
        )
        assert r.status_code == 201, r.text
    for gpu in range(2):
        r = op.post("/v1/spares", json={"node": "spare-1", "gpu": gpu, "nvlink_domain": "nvl-0"})
        assert r.status_code == 201, r.text
    stack.loop.run(_publish_world(stack.nats_url))
    _wait("the scheduler registers both jobs", lambda: len(op.get("/v1/jobs").json()["items"]) == 2)
    _wait("the detector knows both nodes", lambda: len(op.get("/v1/nodes").json()["items"]) == 2)
    stack.loop.run(_publish_faults(stack.nats_url))
    _wait(
        "the scheduler opens an incident per job",
        lambda: len(op.get("/v1/incidents").json()["items"]) == 2,
    )
    return stack


def _id(client: httpx.Client, path: str, key: str) -> str:
    return str(client.get(path).json()["items"][0][key])


def test_every_route_answers_with_the_documented_fields(world: Stack) -> None:
    op = world.op
    incident_id = _id(op, "/v1/incidents?job_id=job-a", "incident_id")
    slot_id = _id(op, "/v1/spares", "slot_id")
    checks: list[tuple[str, str, Any, set[str], set[str] | None]] = [
        (
            "GET",
            "/v1/clusters",
            None,
            {"items", "next_cursor"},
            {"cluster", "nodes", "gpus", "unhealthy", "spares_available"},
        ),
        ("GET", "/v1/nodes?cluster=local", None, {"items", "next_cursor"}, NODE),
        ("GET", "/v1/nodes/node-1", None, NODE, None),
        ("GET", "/v1/spares", None, {"items", "next_cursor"}, SPARE),
        (
            "GET",
            "/v1/spares/depth",
            None,
            {"items", "next_cursor"},
            {"cluster", "nvlink_domain", "available", "floor"},
        ),
        ("GET", f"/v1/spares/{slot_id}", None, SPARE, None),
        ("GET", "/v1/jobs", None, {"items", "next_cursor"}, JOB),
        ("GET", "/v1/jobs/job-a", None, JOB, None),
        (
            "GET",
            "/v1/jobs/job-a/timeline",
            None,
            {"job_id", "events", "generations", "incidents", "migrations"},
            None,
        ),
        ("GET", "/v1/incidents", None, {"items", "next_cursor"}, INCIDENT),
        ("GET", f"/v1/incidents/{incident_id}", None, INCIDENT, None),
        ("GET", "/v1/contracts", None, {"items", "next_cursor"}, CONTRACT),
        ("GET", "/v1/contracts/ctr-a", None, CONTRACT, None),
        ("GET", "/v1/contracts/ctr-a/guarantee", None, GUARANTEE, None),
        ("GET", "/v1/credits", None, {"items", "next_cursor"}, None),
        ("GET", "/v1/ledger/verify", None, {"ok", "checked"}, None),
        ("POST", "/v1/nodes/node-2/drain", {"reason": "test"}, {"node", "cluster"}, None),
        ("POST", "/v1/nodes/node-1/return", None, {"node", "detector", "spare_pool"}, None),
    ]
    for method, path, body, fields, item_fields in checks:
        r = op.request(method, path, json=body)
        assert r.is_success, f"{method} {path}: {r.status_code} {r.text}"
        data = r.json()
        assert fields <= set(data), f"{path} lacks {fields - set(data)}"
        for item in data.get("items", []) if item_fields else []:
            assert item_fields <= set(item), f"{path} item lacks {item_fields - set(item)}"
        for rank in data.get("ranks", []):
            assert set(rank) >= RANK
    r = op.get("/v1/billing/export?period=2026-11&format=csv")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/csv")
    verified = op.get("/v1/ledger/verify").json()
    assert verified["ok"] is True, verified


def test_close_term_before_term_end_is_409(world: Stack) -> None:
    r = world.op.post("/v1/contracts/ctr-a/close-term")
    assert r.status_code == 409
    assert r.headers["content-type"] == "application/problem+json"
    assert world.op.post("/v1/contracts/ctr-zz/close-term").status_code == 404


def test_tenant_a_cannot_read_tenant_bs_objects(world: Stack) -> None:
    acme, globex = world.acme, world.globex
    b_incident = _id(globex, "/v1/incidents", "incident_id")
    for foreign, missing in (
        ("/v1/jobs/job-b", "/v1/jobs/job-zz"),
        ("/v1/jobs/job-b/timeline", "/v1/jobs/job-zz/timeline"),
        (f"/v1/incidents/{b_incident}", "/v1/incidents/inc-zz"),
        ("/v1/contracts/ctr-b", "/v1/contracts/ctr-zz"),
        ("/v1/contracts/ctr-b/guarantee", "/v1/contracts/ctr-zz/guarantee"),
    ):
        assert world.op.get(foreign).status_code == 200
        a, b = acme.get(foreign), acme.get(missing)
        assert a.status_code == b.status_code == 404, foreign
        fid = foreign.split("/")[3]
        mid = missing.split("/")[3]
        assert a.text.replace(fid, "ID") == b.text.replace(mid, "ID")
    for path in ("/v1/jobs", "/v1/incidents", "/v1/contracts"):
        assert {i["tenant"] for i in acme.get(path).json()["items"]} == {"acme"}
        assert {i["tenant"] for i in globex.get(path).json()["items"]} == {"globex"}
    assert acme.get("/v1/incidents?tenant=globex").json()["items"] == []
    for path in ("/v1/nodes", "/v1/spares", "/v1/clusters", "/v1/billing/export?period=2026-11"):
        assert acme.get(path).status_code == 403
    assert httpx.get(f"{world.url}/v1/jobs").status_code == 401


def test_invalid_input_names_the_field(world: Stack) -> None:
    r = world.op.post(
        "/v1/contracts",
        json={
            "tenant": "acme",
            "term_start": "2026-01-01T00:00:00Z",
            "term_end": "2027-01-01T00:00:00Z",
            "renewal_fee_minor": 1,
            "currency": "XYZ",
        },
    )
    assert r.status_code == 422  # billing's ISO 4217 check, passed through with its field
    assert r.json()["field"] == "currency"
    r = world.op.get("/v1/incidents?limit=0")
    assert r.status_code == 422
    assert r.json()["field"] == "limit"


def test_dashboard_shows_the_real_services_numbers(world: Stack) -> None:
    page = world.op.get("/ui")
    assert page.status_code == 200
    expected = expected_figures(lambda p: world.op.get(p).json())
    assert shown_figures(elements_by_testid(page.text), set(expected)) == expected
