"""The API's pure rules: operator-token policy, pagination, tenant scoping, dashboard figures."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from services.api.auth import Principal, new_token, token_digest
from services.api.gateway import ApiProblem
from services.api.models import ContractRequest, SpareDepth, SpareRegistration, TokenRequest
from services.api.routes.common import page_locally, tenant_filter
from services.api.routes.fleet import merge_clusters
from services.api.settings import ApiSettings, operator_token_problem
from services.api.ui import gauge_svg, incident_buckets
from torchrelay.settings import SettingsError, load_settings

OPERATOR = Principal("operator", None, "op")
ACME = Principal("tenant", "acme", "t1")


@pytest.mark.parametrize(
    ("token", "why"),
    [
        (None, "required"),
        ("short-secret", "shorter than 24"),
        ("trdev_" + "k" * 40, "development token"),
        ("changeme-changeme-changeme-123", "placeholder"),
        ("a" * 30, "placeholder"),
    ],
)
def test_production_refuses_weak_operator_tokens(token: str | None, why: str) -> None:
    problem = operator_token_problem(token)
    assert problem is not None
    assert "TORCHRELAY_OPERATOR_TOKEN" in problem
    assert why in problem


def test_production_accepts_a_random_operator_token() -> None:
    assert operator_token_problem(new_token()) is None


def test_settings_refuse_dev_token_in_production_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHRELAY_ENVIRONMENT", "production")
    monkeypatch.setenv("TORCHRELAY_OPERATOR_TOKEN", new_token(development=True))
    with pytest.raises(SettingsError, match="TORCHRELAY_OPERATOR_TOKEN"):
        load_settings(ApiSettings)
    monkeypatch.delenv("TORCHRELAY_OPERATOR_TOKEN")
    with pytest.raises(SettingsError, match="TORCHRELAY_OPERATOR_TOKEN is required"):
        load_settings(ApiSettings)


def test_development_accepts_the_dev_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHRELAY_ENVIRONMENT", "development")
    token = new_token(development=True)
    monkeypatch.setenv("TORCHRELAY_OPERATOR_TOKEN", token)
    cfg = load_settings(ApiSettings)
    assert cfg.operator_token is not None
    assert cfg.operator_token.get_secret_value() == token


def test_token_digest_is_keyed_and_hides_the_secret() -> None:
    token = new_token()
    assert token.startswith("tr_")
    assert len(token) > 40
    d1, d2 = token_digest(b"pepper-1", token), token_digest(b"pepper-2", token)
    assert d1 != d2
    assert token not in d1


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 120), limit=st.integers(1, 50))
def test_local_pages_cover_the_list_once_in_order(n: int, limit: int) -> None:
    items = list(range(n))
    seen: list[int] = []
    cursor: str | None = None
    while True:
        page, cursor = page_locally(items, limit, cursor)
        assert len(page) <= limit
        seen.extend(page)
        if cursor is None:
            break
    assert seen == items


def test_a_foreign_cursor_is_refused_naming_the_field() -> None:
    with pytest.raises(ApiProblem) as err:
        page_locally([1, 2], 1, "abc")
    assert err.value.status == 422
    assert err.value.field == "cursor"


def test_tenant_filter_pins_a_tenant_and_hides_others() -> None:
    assert tenant_filter(OPERATOR, None) == (None, True)
    assert tenant_filter(OPERATOR, "globex") == ("globex", True)
    assert tenant_filter(ACME, None) == ("acme", True)
    assert tenant_filter(ACME, "acme") == ("acme", True)
    assert tenant_filter(ACME, "globex") == ("acme", False)
    assert ACME.sees("acme")
    assert not ACME.sees("globex")
    assert not ACME.sees(None)
    assert OPERATOR.sees("globex")


def test_clusters_get_spare_counts_including_spare_only_clusters() -> None:
    merged = merge_clusters(
        [{"cluster": "east", "nodes": 4, "gpus": 32, "unhealthy": 1}],
        [
            SpareDepth(cluster="east", nvlink_domain="a", available=2, floor=1),
            SpareDepth(cluster="east", nvlink_domain="b", available=1, floor=1),
            SpareDepth(cluster="west", nvlink_domain="a", available=5, floor=0),
        ],
    )
    assert [(c.cluster, c.nodes, c.spares_available, c.spare_domains) for c in merged] == [
        ("east", 4, 3, 2),
        ("west", 0, 5, 1),
    ]


def test_token_request_names_the_tenant_field() -> None:
    with pytest.raises(ValidationError) as err:
        TokenRequest(scope="tenant")
    assert "tenant is required" in str(err.value)
    with pytest.raises(ValidationError):
        TokenRequest(scope="operator", tenant="acme")
    assert TokenRequest(scope="tenant", tenant="acme").tenant == "acme"


def test_contract_request_refuses_a_backward_term() -> None:
    now = datetime.now(UTC)
    with pytest.raises(ValidationError, match="term_end must be after term_start"):
        ContractRequest(
            tenant="acme",
            term_start=now,
            term_end=now - timedelta(days=1),
            renewal_fee_minor=1,
            currency="USD",
        )


def test_spare_registration_leaves_the_slot_id_to_the_pool() -> None:
    slot = SpareRegistration(node="n1", gpu=3, cluster="east").to_slot()
    assert "slot_id" not in slot
    assert slot["nvlink_domain"] == "default"
    assert SpareRegistration(slot_id="s-1", node="n1", gpu=3).to_slot()["slot_id"] == "s-1"


def test_incident_buckets_hourly_then_daily() -> None:
    now = datetime(2026, 1, 2, 12, 30, tzinfo=UTC)
    unit, buckets = incident_buckets(
        [now - timedelta(minutes=5), now - timedelta(hours=3), now + timedelta(seconds=5)], now
    )
    assert unit == "hour"
    assert len(buckets) == 24
    assert sum(c for _, c in buckets) == 3
    assert buckets[-1][1] == 2  # this hour, including the one a little in the future
    unit, buckets = incident_buckets([now - timedelta(days=2), now - timedelta(days=40)], now)
    assert unit == "day"
    assert len(buckets) == 30
    assert sum(c for _, c in buckets) == 1  # the 40-day-old one is outside the window


def test_gauge_shows_the_ratio() -> None:
    svg = gauge_svg(0.75, 0.9, met=False)
    assert "75.0%" in svg
    assert "#c62828" in svg
    assert "100.0%" in gauge_svg(1.0, 0.9, met=True)
