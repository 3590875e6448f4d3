"""Every route of docs/interfaces.md against real NATS responders: fields, auth, tenancy, errors."""

from __future__ import annotations

from typing import Any

import pytest
import redis as redis_sync

from services.api.app import create_app
from services.api.settings import ApiSettings
from tests.unit.api.canned import BackgroundLoop, CannedServices
from tests.unit.api.conftest import TestClient
from tests.unit.api.expect import (
    CONTRACT,
    GOODPUT,
    GUARANTEE,
    INCIDENT,
    JOB,
    NODE,
    RANK,
    SPARE,
)

NEW_CONTRACT = {
    "tenant": "acme",
    "term_start": "2026-01-01T00:00:00Z",
    "term_end": "2027-01-01T00:00:00Z",
    "renewal_fee_minor": 500000,
    "currency": "EUR",
}

# (method, path, body, fields of the answer, fields of each list item or None, status)
ROUTES: list[tuple[str, str, Any, set[str], set[str] | None, int]] = [
    (
        "POST",
        "/v1/tokens",
        {"scope": "tenant", "tenant": "acme"},
        {"token", "scope", "tenant"},
        None,
        201,
    ),
    (
        "GET",
        "/v1/clusters",
        None,
        {"items", "next_cursor"},
        {"cluster", "nodes", "gpus", "unhealthy", "spares_available"},
        200,
    ),
    ("GET", "/v1/nodes?cluster=local", None, {"items", "next_cursor"}, NODE, 200),
    ("GET", "/v1/nodes/node-1", None, NODE, None, 200),
    (
        "POST",
        "/v1/nodes/node-2/drain",
        {"reason": "kernel upgrade"},
        {"node", "cluster"},
        None,
        202,
    ),
    ("POST", "/v1/nodes/node-1/return", None, {"node", "detector", "spare_pool"}, None, 200),
    ("GET", "/v1/spares", None, {"items", "next_cursor"}, SPARE, 200),
    (
        "POST",
        "/v1/spares",
        {"node": "spare-9", "gpu": 0, "nvlink_domain": "nvl-2"},
        SPARE,
        None,
        201,
    ),
    (
        "GET",
        "/v1/spares/depth",
        None,
        {"items", "next_cursor"},
        {"cluster", "nvlink_domain", "available", "floor"},
        200,
    ),
    ("GET", "/v1/spares/local.spare-1.0", None, SPARE, None, 200),
    ("GET", "/v1/jobs", None, {"items", "next_cursor"}, JOB, 200),
    ("GET", "/v1/jobs/job-a", None, JOB, None, 200),
    (
        "GET",
        "/v1/jobs/job-a/timeline",
        None,
        {"job_id", "events", "generations", "incidents", "migrations"},
        None,
        200,
    ),
    ("GET", "/v1/jobs/job-a/goodput", None, GOODPUT | {"job_id", "incidents"}, None, 200),
    ("GET", "/v1/tenants/acme/goodput", None, GOODPUT | {"tenant", "jobs", "terms"}, None, 200),
    ("GET", "/v1/incidents", None, {"items", "next_cursor"}, INCIDENT, 200),
    ("GET", "/v1/incidents/inc-a1", None, INCIDENT, None, 200),
    ("POST", "/v1/contracts", NEW_CONTRACT, CONTRACT, None, 201),
    ("GET", "/v1/contracts", None, {"items", "next_cursor"}, CONTRACT, 200),
    ("GET", "/v1/contracts/ctr-a", None, CONTRACT, None, 200),
    ("GET", "/v1/contracts/ctr-a/guarantee", None, GUARANTEE, None, 200),
    ("POST", "/v1/contracts/ctr-b/close-term", None, {"guarantee", "credit"}, None, 200),
    (
        "GET",
        "/v1/credits",
        None,
        {"items", "next_cursor"},
        {"credit_id", "contract_id", "tenant", "amount_minor", "currency"},
        200,
    ),
    ("GET", "/v1/ledger/verify", None, {"ok", "checked", "first_bad"}, None, 200),
]
OPERATOR_ONLY = [
    r
    for r in ROUTES
    if not r[1].startswith(
        ("/v1/jobs", "/v1/tenants/acme", "/v1/incidents", "/v1/credits", "/v1/contracts/ctr-a")
    )
    and (r[0], r[1]) != ("GET", "/v1/contracts")
] + [("GET", "/v1/billing/export?period=2026-11", None, set(), None, 200)]


def _call(
    client: TestClient, method: str, path: str, body: Any, headers: dict[str, str] | None
) -> Any:
    return client.request(method, path, json=body, headers=headers or {})


@pytest.mark.parametrize(
    ("method", "path", "body", "fields", "item_fields", "status"),
    ROUTES,
    ids=[f"{r[0]} {r[1]}" for r in ROUTES],
)
def test_every_route_answers_with_the_documented_fields(
    client: TestClient,
    operator: dict[str, str],
    method: str,
    path: str,
    body: Any,
    fields: set[str],
    item_fields: set[str] | None,
    status: int,
) -> None:
    r = _call(client, method, path, body, operator)
    assert r.status_code == status, r.text
    data = r.json()
    assert fields <= set(data), f"missing {fields - set(data)}"
    if item_fields is not None:
        assert data["items"], "the canned services have items for every list"
        for item in data["items"]:
            assert item_fields <= set(item), f"missing {item_fields - set(item)}"
    if "ranks" in data:
        assert all(set(rank) >= RANK for rank in data["ranks"])


@pytest.mark.parametrize(
    ("method", "path", "body", "fields", "item_fields", "status"),
    [*ROUTES, ("GET", "/v1/billing/export?period=2026-11", None, set(), None, 200)],
    ids=[f"{r[0]} {r[1]}" for r in ROUTES] + ["GET export"],
)
def test_no_token_is_401_problem(
    client: TestClient,
    method: str,
    path: str,
    body: Any,
    fields: set[str],
    item_fields: set[str] | None,
    status: int,
) -> None:
    r = _call(client, method, path, body, None)
    assert r.status_code == 401
    assert r.headers["content-type"] == "application/problem+json"
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert r.json()["status"] == 401
    r = _call(client, method, path, body, {"Authorization": "Bearer tr_not-a-real-token"})
    assert r.status_code == 401
    r = _call(client, method, path, body, {"Authorization": "Basic dXNlcjpwdw=="})
    assert r.status_code == 401


@pytest.mark.parametrize(
    ("method", "path", "body", "fields", "item_fields", "status"),
    OPERATOR_ONLY,
    ids=[f"{r[0]} {r[1]}" for r in OPERATOR_ONLY],
)
def test_tenant_token_on_operator_route_is_403(
    client: TestClient,
    acme: dict[str, str],
    canned: CannedServices,
    method: str,
    path: str,
    body: Any,
    fields: set[str],
    item_fields: set[str] | None,
    status: int,
) -> None:
    before = len(canned.requests)
    r = _call(client, method, path, body, acme)
    assert r.status_code == 403, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert len(canned.requests) == before, "a refused request must not reach a service"


FOREIGN = [
    ("/v1/jobs/job-b", "/v1/jobs/job-zz", "job-b", "job-zz"),
    ("/v1/jobs/job-b/timeline", "/v1/jobs/job-zz/timeline", "job-b", "job-zz"),
    ("/v1/incidents/inc-b1", "/v1/incidents/inc-zz", "inc-b1", "inc-zz"),
    ("/v1/contracts/ctr-b", "/v1/contracts/ctr-zz", "ctr-b", "ctr-zz"),
    ("/v1/contracts/ctr-b/guarantee", "/v1/contracts/ctr-zz/guarantee", "ctr-b", "ctr-zz"),
]


@pytest.mark.parametrize(("foreign", "missing", "fid", "mid"), FOREIGN, ids=[f[0] for f in FOREIGN])
def test_another_tenants_object_answers_exactly_like_a_missing_one(
    client: TestClient,
    acme: dict[str, str],
    operator: dict[str, str],
    foreign: str,
    missing: str,
    fid: str,
    mid: str,
) -> None:
    assert client.get(foreign, headers=operator).status_code == 200  # it does exist
    a = client.get(foreign, headers=acme)
    b = client.get(missing, headers=acme)
    assert a.status_code == b.status_code == 404
    assert a.headers["content-type"] == b.headers["content-type"] == "application/problem+json"
    assert a.text.replace(fid, "ID") == b.text.replace(mid, "ID")


def test_tenant_lists_hold_only_its_own_objects(
    client: TestClient,
    acme: dict[str, str],
    globex: dict[str, str],
    canned: CannedServices,
) -> None:
    for path, key in [
        ("/v1/jobs", "job_id"),
        ("/v1/incidents", "incident_id"),
        ("/v1/contracts", "contract_id"),
    ]:
        mine = client.get(path, headers=acme).json()["items"]
        theirs = client.get(path, headers=globex).json()["items"]
        assert mine
        assert theirs
        assert {i["tenant"] for i in mine} == {"acme"}
        assert {i["tenant"] for i in theirs} == {"globex"}
        assert not {i[key] for i in mine} & {i[key] for i in theirs}
    assert canned.last("scheduler", "incident_list")["tenant"] == "globex"
    # Asking for the other tenant by name yields nothing, not an error that confirms it.
    assert client.get("/v1/incidents?tenant=globex", headers=acme).json()["items"] == []
    assert client.get("/v1/jobs?tenant=globex", headers=acme).json()["items"] == []
    assert client.get("/v1/credits", headers=globex).json()["items"] == []
    assert client.get("/v1/credits?contract_id=ctr-a", headers=globex).json()["items"] == []
    assert [c["credit_id"] for c in client.get("/v1/credits", headers=acme).json()["items"]] == [
        "cr-a"
    ]


INVALID: list[tuple[str, str, Any, str]] = [
    ("GET", "/v1/incidents?limit=0", None, "limit"),
    ("GET", "/v1/incidents?limit=abc", None, "limit"),
    ("GET", "/v1/incidents?limit=100000", None, "limit"),
    ("GET", "/v1/incidents?cursor=%21%21", None, "cursor"),
    ("GET", "/v1/incidents?from=yesterday", None, "from"),
    ("GET", "/v1/incidents?from=2026-01-01T00:00:00", None, "from"),
    ("GET", "/v1/incidents?from=2026-02-01T00:00:00Z&to=2026-01-01T00:00:00Z", None, "to"),
    ("GET", "/v1/incidents?resolution=fixed", None, "resolution"),
    ("GET", "/v1/incidents?job_id=a.b", None, "job_id"),
    ("GET", "/v1/nodes?cluster=a%20b", None, "cluster"),
    ("GET", "/v1/nodes/no%20de", None, "node"),
    ("GET", "/v1/spares?state=broken", None, "state"),
    ("GET", "/v1/billing/export?period=2026-13", None, "period"),
    ("GET", "/v1/billing/export", None, "period"),
    ("GET", "/v1/billing/export?period=2026-01&format=xml", None, "format"),
    ("POST", "/v1/tokens", {"scope": "tenant"}, "tenant"),
    ("POST", "/v1/tokens", {"scope": "operator", "tenant": "acme"}, "tenant"),
    ("POST", "/v1/tokens", {"scope": "root"}, "scope"),
    ("POST", "/v1/tokens", {"scope": "tenant", "tenant": "a b"}, "tenant"),
    ("POST", "/v1/contracts", {**NEW_CONTRACT, "term_end": "2025-01-01T00:00:00Z"}, "term_end"),
    ("POST", "/v1/contracts", {**NEW_CONTRACT, "currency": "usd"}, "currency"),
    ("POST", "/v1/contracts", {**NEW_CONTRACT, "renewal_fee_minor": -1}, "renewal_fee_minor"),
    ("POST", "/v1/contracts", {**NEW_CONTRACT, "threshold": 1.5}, "threshold"),
    ("POST", "/v1/contracts", {**NEW_CONTRACT, "surprise": 1}, "surprise"),
    ("POST", "/v1/contracts", {k: v for k, v in NEW_CONTRACT.items() if k != "tenant"}, "tenant"),
    ("POST", "/v1/spares", {"node": "n1", "gpu": -1}, "gpu"),
    ("POST", "/v1/spares", {"gpu": 0}, "node"),
    ("POST", "/v1/nodes/node-1/drain", {"reason": ""}, "reason"),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "field"), INVALID, ids=[f"{i[0]} {i[1]} {i[3]}" for i in INVALID]
)
def test_invalid_input_is_422_naming_the_field_and_reaches_no_service(
    client: TestClient,
    operator: dict[str, str],
    canned: CannedServices,
    method: str,
    path: str,
    body: Any,
    field: str,
) -> None:
    before = len(canned.requests)
    r = _call(client, method, path, body, operator)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    problem = r.json()
    assert problem["field"] == field
    assert field in problem["detail"]
    assert len(canned.requests) == before


def test_malformed_json_body_is_a_problem(client: TestClient, operator: dict[str, str]) -> None:
    r = client.post(
        "/v1/contracts",
        content=b"{not json",
        headers={**operator, "Content-Type": "application/json"},
    )
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["field"] == "body"


def test_service_errors_map_to_http(client: TestClient, operator: dict[str, str]) -> None:
    r = client.post("/v1/contracts", json={**NEW_CONTRACT, "currency": "XYZ"}, headers=operator)
    assert r.status_code == 422
    assert r.json()["field"] == "currency"
    assert r.json()["service"] == "billing"
    r = client.post("/v1/contracts/ctr-a/close-term", headers=operator)
    assert r.status_code == 409
    assert r.headers["content-type"] == "application/problem+json"
    r = client.get("/v1/incidents?cursor=zz", headers=operator)
    assert r.status_code == 422
    assert r.json()["field"] == "cursor"
    r = client.post("/v1/contracts/ctr-zz/close-term", headers=operator)
    assert r.status_code == 404


def test_a_service_that_does_not_answer_is_503_naming_it(
    nats_url: str,
    api_settings: ApiSettings,
    operator: dict[str, str],
) -> None:
    loop = BackgroundLoop()
    services = CannedServices()
    loop.run(services.start(nats_url, only={"scheduler"}))
    try:
        with TestClient(create_app(api_settings)) as client:
            assert client.get("/v1/jobs", headers=operator).status_code == 200
            for path, service in [
                ("/v1/nodes", "detector"),
                ("/v1/contracts", "billing"),
                ("/v1/spares", "spare_pool"),
                ("/v1/clusters", "detector"),
            ]:
                r = client.get(path, headers=operator)
                assert r.status_code == 503, r.text
                assert r.headers["content-type"] == "application/problem+json"
                assert r.json()["service"] == service
                assert service in r.json()["detail"]
    finally:
        loop.run(services.stop())
        loop.close()


def test_tokens_are_shown_once_and_stored_only_hashed(
    client: TestClient,
    operator: dict[str, str],
    redis_url: str,
) -> None:
    r = client.post("/v1/tokens", json={"scope": "operator"}, headers=operator)
    assert r.status_code == 201
    assert r.headers["cache-control"] == "no-store"
    token = r.json()["token"]
    assert (
        client.get("/v1/clusters", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    )
    store = redis_sync.Redis.from_url(redis_url)
    try:
        keys = list(store.scan_iter("tr:api:*"))
        assert keys
        for key in keys:
            assert token.encode() not in key
            if store.type(key) == b"hash":
                assert all(token.encode() not in v for v in store.hgetall(key).values())
    finally:
        store.close()


def test_tenant_token_reads_its_own_objects(client: TestClient, acme: dict[str, str]) -> None:
    for path in (
        "/v1/jobs/job-a",
        "/v1/jobs/job-a/timeline",
        "/v1/incidents/inc-a1",
        "/v1/contracts/ctr-a",
        "/v1/contracts/ctr-a/guarantee",
    ):
        assert client.get(path, headers=acme).status_code == 200, path


def test_pagination_follows_next_cursor(client: TestClient, operator: dict[str, str]) -> None:
    seen = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 1}
        if cursor:
            params["cursor"] = cursor
        page = client.get("/v1/incidents", params=params, headers=operator).json()
        seen += [i["incident_id"] for i in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ["inc-a1", "inc-a2", "inc-b1"]
    page = client.get("/v1/nodes", params={"limit": 2}, headers=operator).json()
    assert len(page["items"]) == 2
    rest = client.get(
        "/v1/nodes", params={"limit": 2, "cursor": page["next_cursor"]}, headers=operator
    ).json()
    assert [n["node"] for n in rest["items"]] == ["node-3"]
    assert rest["next_cursor"] is None


def test_filters_reach_the_service(
    client: TestClient, operator: dict[str, str], canned: CannedServices
) -> None:
    r = client.get(
        "/v1/incidents",
        params={
            "job_id": "job-a",
            "resolution": "checkpoint_restart",
            "from": "2026-01-01T00:00:00+02:00",
            "to": "2030-01-01T00:00:00Z",
        },
        headers=operator,
    )
    assert [i["incident_id"] for i in r.json()["items"]] == ["inc-a2"]
    sent = canned.last("scheduler", "incident_list")
    assert sent["job_id"] == "job-a"
    assert sent["from"].startswith("2026-01-01T00:00:00")
    client.post("/v1/nodes/node-2/drain", json={"cluster": "local"}, headers=operator)
    assert canned.last("scheduler", "drain")["cluster"] == "local"


def test_billing_export_as_csv_and_json(client: TestClient, operator: dict[str, str]) -> None:
    r = client.get("/v1/billing/export?period=2026-11&format=csv", headers=operator)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/csv")
    assert r.text.startswith("BilledCost,")
    r = client.get("/v1/billing/export?period=2026-11&format=json", headers=operator)
    assert r.headers["content-type"] == "application/json"
    assert r.json()[0]["ChargeCategory"] == "Credit"


def test_health_ready_and_metrics_need_no_token(
    client: TestClient, operator: dict[str, str]
) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["ready"] is True
    client.get("/v1/jobs", headers=operator)
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    assert (
        'torchrelay_http_request_seconds_count{method="GET",route="/v1/jobs",status="200"}'
        in metrics.text
    )


def test_unknown_route_is_a_problem(client: TestClient) -> None:
    r = client.get("/v1/nope")
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/problem+json"


def test_readyz_is_503_when_nats_is_gone(
    fresh_nats: Any, redis_url: str, canned: CannedServices
) -> None:
    cfg = ApiSettings(
        nats_url=fresh_nats.url,
        redis_url=redis_url,
        environment="test",
        operator_token="trdev_x" * 4,
        connect_timeout_s=5,
    )
    with TestClient(create_app(cfg)) as client:
        assert client.get("/readyz").status_code == 200
        fresh_nats.kill()
        r = client.get("/readyz")
        assert r.status_code == 503
        assert r.json()["nats"] == "down"


def test_token_store_down_is_503_naming_redis(
    fresh_redis: Any,
    nats_url: str,
    canned: CannedServices,
    operator: dict[str, str],
) -> None:
    cfg = ApiSettings(
        nats_url=nats_url,
        redis_url=fresh_redis.url,
        environment="test",
        operator_token=operator["Authorization"][7:],
        connect_timeout_s=5,
    )
    with TestClient(create_app(cfg)) as client:
        issued = client.post(
            "/v1/tokens", json={"scope": "tenant", "tenant": "acme"}, headers=operator
        ).json()["token"]
        fresh_redis.kill()
        r = client.get("/v1/jobs", headers={"Authorization": f"Bearer {issued}"})
        assert r.status_code == 503
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["service"] == "redis"
        assert client.get("/readyz").json()["redis"] == "down"


async def test_a_burst_of_first_requests_all_succeed(
    nats_url: str,
    redis_url: str,
    canned: CannedServices,
) -> None:
    import asyncio

    import httpx

    from tests.unit.api.canned import OPERATOR_TOKEN, ServerThread

    loop = BackgroundLoop()
    cfg = ApiSettings(
        nats_url=nats_url,
        redis_url=redis_url,
        environment="test",
        operator_token=OPERATOR_TOKEN,
        rpc_timeout_s=10.0,
    )
    server = ServerThread(loop, create_app(cfg))
    url = await asyncio.to_thread(server.start)
    try:
        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(
            base_url=url,
            limits=limits,
            timeout=60,
            headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"},
        ) as http:
            answers = await asyncio.gather(*(http.get("/v1/incidents") for _ in range(150)))
        assert {a.status_code for a in answers} == {200}
    finally:
        await asyncio.to_thread(server.stop)
        loop.close()


def test_tokens_are_listed_without_their_secrets_and_only_to_operators(
    client: TestClient, operator: dict[str, str], acme: dict[str, str]
) -> None:
    issued = client.post(
        "/v1/tokens", json={"scope": "tenant", "tenant": "globex"}, headers=operator
    ).json()
    r = client.get("/v1/tokens", headers=operator)
    assert r.status_code == 200, r.text
    rows = {row["token_id"]: row for row in r.json()["items"]}
    assert rows[issued["token_id"]] == {
        "token_id": issued["token_id"],
        "scope": "tenant",
        "tenant": "globex",
        "created_at": rows[issued["token_id"]]["created_at"],
        "configured": False,
    }
    assert rows[issued["token_id"]]["created_at"].startswith("20")
    assert issued["token"] not in r.text
    assert acme["Authorization"][7:] not in r.text
    configured = [row for row in rows.values() if row["configured"]]
    assert [row["scope"] for row in configured] == ["operator"]
    assert client.get("/v1/tokens", headers=acme).status_code == 403
    page = client.get("/v1/tokens", params={"limit": 1}, headers=operator).json()
    assert len(page["items"]) == 1
    assert page["next_cursor"] == "1"


def test_a_revoked_token_is_refused_at_once_and_revoking_it_again_is_404(
    client: TestClient, operator: dict[str, str]
) -> None:
    issued = client.post(
        "/v1/tokens", json={"scope": "tenant", "tenant": "acme"}, headers=operator
    ).json()
    bearer = {"Authorization": f"Bearer {issued['token']}"}
    # Used twice: the second answer comes from the token cache (and the kept answers).
    assert client.get("/v1/incidents", headers=bearer).status_code == 200
    assert client.get("/v1/incidents", headers=bearer).status_code == 200
    r = client.delete(f"/v1/tokens/{issued['token_id']}", headers=operator)
    assert r.status_code == 204, r.text
    r = client.get("/v1/incidents", headers=bearer)
    assert r.status_code == 401
    assert r.headers["content-type"] == "application/problem+json"
    listed = client.get("/v1/tokens", headers=operator).json()["items"]
    assert issued["token_id"] not in {row["token_id"] for row in listed}
    again = client.delete(f"/v1/tokens/{issued['token_id']}", headers=operator)
    assert again.status_code == 404
    assert again.json()["field"] == "token_id"
    assert issued["token_id"] in again.json()["detail"]


def test_the_configured_operator_token_cannot_be_revoked_through_the_api(
    client: TestClient, operator: dict[str, str], acme: dict[str, str]
) -> None:
    rows = client.get("/v1/tokens", headers=operator).json()["items"]
    configured = next(row["token_id"] for row in rows if row["configured"])
    r = client.delete(f"/v1/tokens/{configured}", headers=operator)
    assert r.status_code == 409
    assert "TORCHRELAY_OPERATOR_TOKEN" in r.json()["detail"]
    assert client.get("/v1/clusters", headers=operator).status_code == 200
    assert client.delete(f"/v1/tokens/{configured}", headers=acme).status_code == 403
    bad = client.delete("/v1/tokens/not-an-id", headers=operator)
    assert bad.status_code == 422
    assert bad.json()["field"] == "token_id"
