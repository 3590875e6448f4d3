"""The hot path (``services.api.kept``): a repeated ``GET /v1/incidents`` of a remembered
token answered before FastAPI, exactly as the route answers it, and nothing else."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis as redis_sync
from fastapi.security.utils import get_authorization_scheme_param

from services.api.app import create_app
from services.api.auth import TokenStore, token_digest
from services.api.kept import KeptAnswers, bearer_token
from services.api.settings import ApiSettings
from tests.unit.api.canned import OPERATOR_TOKEN, BackgroundLoop, CannedServices, ServerThread
from tests.unit.api.conftest import TestClient, tenant_token


class Counted(KeptAnswers):
    """The app's kept answers, counting the requests answered here."""

    def __init__(self, inner: KeptAnswers) -> None:
        super().__init__(inner.state)
        self.answered = 0

    async def answer(self, scope: Any, send: Any) -> bool:
        async def counting(message: dict[str, Any]) -> None:
            # Counted before the answer goes out: a client on another thread may read the
            # count as soon as it has the answer.
            if message["type"] == "http.response.start":
                self.answered += 1
            await send(message)

        return await super().answer(scope, counting)


def counted(client: TestClient) -> Counted:
    app: Any = client.app
    app.kept = Counted(app.kept)
    return app.kept  # type: ignore[no-any-return]


def slow_path_only(client: TestClient) -> None:
    app: Any = client.app
    app.kept = None


def kept_client(settings: ApiSettings, **update: Any) -> TestClient:
    # Answers kept long enough that a slow test machine cannot outlast them.
    return TestClient(create_app(settings.model_copy(update={"list_cache_s": 60.0, **update})))


@pytest.fixture
def kept(api_settings: ApiSettings, canned: CannedServices) -> Iterator[TestClient]:
    with kept_client(api_settings) as c:
        yield c


def test_the_kept_answer_is_the_routes_answer_byte_for_byte(
    kept: TestClient, operator: dict[str, str]
) -> None:
    hot = counted(kept)
    made = kept.get("/v1/incidents?limit=2", headers=operator)  # asks the scheduler
    assert hot.answered == 0
    answered_here = kept.get("/v1/incidents?limit=2", headers=operator)
    assert hot.answered == 1
    slow_path_only(kept)
    from_route = kept.get("/v1/incidents?limit=2", headers=operator)  # the route's cache hit
    for response in (answered_here, from_route):
        assert response.status_code == made.status_code == 200
        assert response.content == made.content
        assert response.headers == made.headers
    assert len(made.json()["items"]) == 2


def test_only_a_get_of_the_incident_list_with_a_bearer_token_is_answered_here(
    kept: TestClient, operator: dict[str, str]
) -> None:
    hot = counted(kept)
    kept.get("/v1/incidents", headers=operator)
    kept.get("/v1/incidents", headers=operator)
    assert hot.answered == 1
    assert kept.head("/v1/incidents", headers=operator).status_code == 405
    assert kept.post("/v1/incidents", headers=operator).status_code == 405
    assert kept.get("/v1/incidents/", headers=operator, follow_redirects=False).status_code == 307
    lower = {"Authorization": operator["Authorization"].replace("Bearer", "bearer")}
    assert kept.get("/v1/incidents", headers=lower).status_code == 200  # as HTTPBearer reads it
    assert hot.answered == 2


def test_no_token_an_unknown_token_or_another_scheme_is_401_through_the_hot_path(
    kept: TestClient, operator: dict[str, str]
) -> None:
    hot = counted(kept)
    kept.get("/v1/incidents", headers=operator)
    assert kept.get("/v1/incidents", headers=operator).status_code == 200
    answered = hot.answered
    for headers in (
        {},
        {"Authorization": "Bearer tr_not-a-token-anyone-was-given"},
        {"Authorization": operator["Authorization"].replace("Bearer", "Basic")},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer   "},
    ):
        r = kept.get("/v1/incidents", headers=headers)
        assert r.status_code == 401, headers
        assert r.headers["content-type"] == "application/problem+json"
    assert hot.answered == answered


def test_a_tenant_token_is_still_403_on_operator_routes_and_sees_only_its_own(
    kept: TestClient, operator: dict[str, str]
) -> None:
    hot = counted(kept)
    acme, globex = tenant_token(kept, "acme"), tenant_token(kept, "globex")
    everyone = kept.get("/v1/incidents", headers=operator).json()["items"]
    assert {i["tenant"] for i in everyone} >= {"acme", "globex"}
    for _ in range(3):  # the first round fills the caches, the others are answered here
        mine = kept.get("/v1/incidents", headers=acme).json()["items"]
        theirs = kept.get("/v1/incidents", headers=globex).json()["items"]
        assert mine
        assert theirs
        assert {i["tenant"] for i in mine} == {"acme"}
        assert {i["tenant"] for i in theirs} == {"globex"}
        # Asking for another tenant's incidents yields nothing, never their answer.
        asked_for_globex = kept.get("/v1/incidents?tenant=globex", headers=acme)
        assert asked_for_globex.status_code == 200
        assert asked_for_globex.json()["items"] == []
        forbidden = kept.get("/v1/nodes", headers=acme)
        assert forbidden.status_code == 403
        assert forbidden.headers["content-type"] == "application/problem+json"
    assert hot.answered >= 4
    assert kept.get("/v1/incidents", headers=operator).json()["items"] == everyone


def test_an_invalid_query_is_never_answered_here(
    kept: TestClient, operator: dict[str, str]
) -> None:
    hot = counted(kept)
    for _ in range(2):
        r = kept.get("/v1/incidents?limit=0", headers=operator)
        assert r.status_code == 422
        assert r.json()["field"] == "limit"
    assert hot.answered == 0


def test_a_revoked_token_is_refused_once_the_token_cache_time_has_passed(
    api_settings: ApiSettings, canned: CannedServices, redis_url: str
) -> None:
    ttl = 0.5
    with kept_client(api_settings, token_cache_s=ttl) as c:
        hot = counted(c)
        issued = c.post(
            "/v1/tokens",
            json={"scope": "tenant", "tenant": "acme"},
            headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"},
        ).json()
        acme = {"Authorization": f"Bearer {issued['token']}"}
        assert c.get("/v1/incidents", headers=acme).status_code == 200
        assert c.get("/v1/incidents", headers=acme).status_code == 200
        assert hot.answered == 1
        # Revoke: an operator deletes the token's stored digest.
        store = redis_sync.Redis.from_url(redis_url)
        try:
            keys = list(store.scan_iter(match=f"tr:api:token:{issued['token_id']}*"))
            assert len(keys) == 1
            store.delete(*keys)
        finally:
            store.close()
        revoked_at = time.monotonic()
        # Within the token cache time the token may still be answered; after it, never.
        while time.monotonic() < revoked_at + ttl:
            assert c.get("/v1/incidents", headers=acme).status_code in {200, 401}
        for _ in range(3):
            r = c.get("/v1/incidents", headers=acme)
            assert r.status_code == 401
            assert r.headers["content-type"] == "application/problem+json"


def test_the_histogram_counts_kept_answers_under_the_route(
    kept: TestClient, operator: dict[str, str]
) -> None:
    hot = counted(kept)
    for _ in range(3):
        kept.get("/v1/incidents", headers=operator)
    assert hot.answered == 2
    metrics = kept.get("/metrics").text
    line = next(
        x
        for x in metrics.splitlines()
        if x.startswith("torchrelay_http_request_seconds_count")
        and 'route="/v1/incidents"' in x
        and 'status="200"' in x
    )
    assert float(line.rsplit(" ", 1)[1]) == 3


@pytest.mark.parametrize(
    ("headers", "token"),
    [
        ([], None),
        ([(b"authorization", b"Bearer abc")], "abc"),
        ([(b"authorization", b"bearer  abc ")], "abc"),
        ([(b"authorization", b"Basic abc")], None),
        ([(b"authorization", b"Bearer")], None),
        ([(b"authorization", b"Bearer ")], None),
        ([(b"authorization", b"Bearer a"), (b"authorization", b"Bearer b")], "a"),
        ([(b"x-authorization", b"Bearer a")], None),
    ],
)
def test_the_bearer_token_is_read_as_fastapi_reads_it(
    headers: list[tuple[bytes, bytes]], token: str | None
) -> None:
    assert bearer_token(headers) == token
    # The same reading as FastAPI's HTTPBearer (first header, scheme, stripped credentials).
    first = next((v.decode("latin-1") for k, v in headers if k == b"authorization"), None)
    scheme, credentials = get_authorization_scheme_param(first)
    expected = credentials if first and scheme.lower() == "bearer" and credentials else None
    assert token == expected


def test_over_http_the_kept_answer_has_the_routes_status_headers_and_body(
    api_settings: ApiSettings, canned: CannedServices, operator: dict[str, str]
) -> None:
    loop = BackgroundLoop()
    server = ServerThread(loop, create_app(api_settings.model_copy(update={"list_cache_s": 60.0})))
    try:
        url = server.start()
        app: Any = server.server.config.app
        hot = Counted(app.kept)
        app.kept = hot
        with httpx.Client(base_url=url, timeout=10) as http:
            http.get("/v1/incidents?limit=1", headers=operator)  # remembers the token
            answered = hot.answered
            made = http.get("/v1/incidents?limit=2", headers=operator)  # the route makes it
            assert hot.answered == answered
            again = http.get("/v1/incidents?limit=2", headers=operator)
            assert hot.answered == answered + 1
        assert again.status_code == made.status_code == 200
        assert again.content == made.content
        assert again.headers.keys() == made.headers.keys()
        for name in made.headers:
            if name != "date":
                assert again.headers[name] == made.headers[name], name
    finally:
        server.stop()
        loop.close()


def test_the_token_store_digests_a_token_as_token_digest_does() -> None:
    store = TokenStore(None, b"pepper-1")
    for token in ("tr_abc", "trdev_" + "x" * 40, "é"):
        assert store._digest(token) == token_digest(b"pepper-1", token)
    assert TokenStore(None, b"pepper-2")._digest("tr_abc") != store._digest("tr_abc")


def test_a_busy_query_is_refreshed_ahead_and_never_waits_for_the_scheduler(
    api_settings: ApiSettings, canned: CannedServices, operator: dict[str, str]
) -> None:
    def asked() -> int:
        return sum(1 for s, v, _ in canned.requests if (s, v) == ("scheduler", "incident_list"))

    with kept_client(api_settings, list_cache_s=1.0) as c:
        hot = counted(c)
        assert c.get("/v1/incidents", headers=operator).status_code == 200  # the route
        before, sent = asked(), 0
        until = time.monotonic() + 2.6
        while time.monotonic() < until:
            assert c.get("/v1/incidents", headers=operator).status_code == 200
            sent += 1
        # Asked again about every 0.75-1 s in the background; every request answered here.
        assert 2 <= asked() - before <= 4
        assert hot.answered == sent
