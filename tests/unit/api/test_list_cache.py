"""``GET /v1/incidents`` answered from the API's short list cache: same bytes, per scope."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.api.app import create_app
from services.api.settings import ApiSettings
from tests.unit.api.canned import CannedServices
from tests.unit.api.conftest import TestClient, tenant_token


def asked(canned: CannedServices) -> int:
    return sum(1 for s, v, _ in canned.requests if (s, v) == ("scheduler", "incident_list"))


@pytest.fixture
def kept(api_settings: ApiSettings, canned: CannedServices) -> Iterator[TestClient]:
    """The app with answers kept long enough that a slow test machine cannot outlast them."""
    with TestClient(create_app(api_settings.model_copy(update={"list_cache_s": 60.0}))) as c:
        yield c


def test_a_repeated_query_gets_the_same_answer_without_asking_again(
    kept: TestClient, canned: CannedServices, operator: dict[str, str]
) -> None:
    first = kept.get("/v1/incidents?limit=2", headers=operator)
    before = asked(canned)
    again = kept.get("/v1/incidents?limit=2", headers=operator)
    assert asked(canned) == before
    assert first.status_code == again.status_code == 200
    assert again.content == first.content
    assert len(again.json()["items"]) == 2
    for header in ("content-type", "content-length"):
        assert again.headers[header] == first.headers[header]
    kept.get("/v1/incidents?limit=3", headers=operator)  # another query is asked for
    assert asked(canned) == before + 1


def test_each_token_scope_gets_its_own_answer(
    kept: TestClient, canned: CannedServices, operator: dict[str, str]
) -> None:
    acme, globex = tenant_token(kept, "acme"), tenant_token(kept, "globex")
    everyone = kept.get("/v1/incidents", headers=operator).json()["items"]
    assert {i["tenant"] for i in everyone} >= {"acme", "globex"}
    for _ in range(2):  # the second round is answered from the cache
        mine = kept.get("/v1/incidents", headers=acme).json()["items"]
        theirs = kept.get("/v1/incidents", headers=globex).json()["items"]
        assert mine
        assert theirs
        assert {i["tenant"] for i in mine} == {"acme"}
        assert {i["tenant"] for i in theirs} == {"globex"}
    assert kept.get("/v1/incidents", headers=operator).json()["items"] == everyone


def test_a_kept_answer_still_needs_a_known_token(
    kept: TestClient, operator: dict[str, str]
) -> None:
    assert kept.get("/v1/incidents", headers=operator).status_code == 200
    assert kept.get("/v1/incidents").status_code == 401
    stranger = {"Authorization": "Bearer tr_not-a-token-anyone-was-given"}
    r = kept.get("/v1/incidents", headers=stranger)
    assert r.status_code == 401
    assert r.headers["content-type"] == "application/problem+json"
    basic = {"Authorization": operator["Authorization"].replace("Bearer", "Basic")}
    assert kept.get("/v1/incidents", headers=basic).status_code == 401


def test_with_no_cache_time_every_query_is_asked(
    api_settings: ApiSettings, canned: CannedServices, operator: dict[str, str]
) -> None:
    with TestClient(create_app(api_settings.model_copy(update={"list_cache_s": 0.0}))) as c:
        before = asked(canned)
        for _ in range(3):
            assert c.get("/v1/incidents", headers=operator).status_code == 200
        assert asked(canned) == before + 3
