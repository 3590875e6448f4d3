"""The goodput routes: who sees what, the counterfactual's defaults, a contract's price."""

from __future__ import annotations

from tests.unit.api.canned import CannedServices
from tests.unit.api.conftest import TestClient


def test_a_jobs_goodput_adds_up_and_uses_the_operators_defaults(
    client: TestClient, operator: dict[str, str], canned: CannedServices
) -> None:
    r = client.get("/v1/jobs/job-a/goodput", headers=operator)
    assert r.status_code == 200, r.text
    g = r.json()
    lost = sum(i["gpu_seconds_lost"] for i in g["incidents"])
    assert abs(g["gpu_seconds_allocated"] - g["gpu_seconds_progress"] - lost) < 0.0015
    assert {i["incident_id"] for i in g["incidents"]} == {"inc-a1", "inc-a2"}
    # 2 ranks for 200 minutes; the canned incidents stall 57 ms and lose 1 step of 0.5 s
    assert g["gpu_seconds_allocated"] == 2 * 200 * 60
    assert g["incidents"][0]["gpu_seconds_lost"] == round(2 * 0.057 + 2 * 0.5, 3)
    sent = canned.last("scheduler", "job_goodput")
    assert (sent["restart_s"], sent["default_checkpoint_every"]) == (300.0, 1000)
    assert "price_per_gpu_hour_minor" not in sent  # no contract price, no operator price
    assert g["counterfactual"]["money_saved_minor"] is None


def test_the_query_sets_the_counterfactual_and_prices_the_saving(
    client: TestClient, operator: dict[str, str], canned: CannedServices
) -> None:
    r = client.get(
        "/v1/jobs/job-a/goodput",
        params={
            "checkpoint_every": 200,
            "restart_s": 60,
            "price_per_gpu_hour_minor": 300,
            "currency": "EUR",
        },
        headers=operator,
    )
    assert r.status_code == 200, r.text
    cf = r.json()["counterfactual"]
    assert (cf["checkpoint_every"], cf["restart_s"], cf["currency"]) == (200, 60.0, "EUR")
    # the live migration, restarted instead: 2 ranks x (60 s + 100 steps x 0.5 s)
    live = next(i for i in r.json()["incidents"] if i["incident_id"] == "inc-a1")
    assert live["counterfactual_gpu_seconds"] == 2 * (60 + 100 * 0.5)
    expected = round(cf["gpu_seconds_saved"] * 300 / 3600)
    assert cf["money_saved_minor"] == expected
    assert canned.last("scheduler", "job_goodput")["checkpoint_every"] == 200
    bad = client.get("/v1/jobs/job-a/goodput", params={"restart_s": -1}, headers=operator)
    assert bad.status_code == 422
    assert "restart_s" in bad.text


def test_a_contracts_price_prices_the_saving(
    client: TestClient, operator: dict[str, str], canned: CannedServices
) -> None:
    canned.contracts[0]["price_per_gpu_hour_minor"] = 250
    cf = client.get("/v1/jobs/job-a/goodput", headers=operator).json()["counterfactual"]
    assert (cf["price_per_gpu_hour_minor"], cf["currency"]) == (250, "USD")
    assert cf["money_saved_minor"] == round(cf["gpu_seconds_saved"] * 250 / 3600)


def test_a_tenant_sees_its_own_goodput_and_not_anothers(
    client: TestClient, acme: dict[str, str], globex: dict[str, str]
) -> None:
    own = client.get("/v1/jobs/job-a/goodput", headers=acme)
    assert own.status_code == 200
    foreign = client.get("/v1/jobs/job-b/goodput", headers=acme)
    missing = client.get("/v1/jobs/job-zz/goodput", headers=acme)
    assert foreign.status_code == missing.status_code == 404
    assert foreign.text.replace("job-b", "ID") == missing.text.replace("job-zz", "ID")
    assert client.get("/v1/tenants/acme/goodput", headers=globex).status_code == 404
    assert client.get("/v1/tenants/globex/goodput", headers=globex).status_code == 200


def test_a_tenants_goodput_sums_its_jobs_and_each_contract_term(
    client: TestClient, operator: dict[str, str], canned: CannedServices
) -> None:
    canned.contracts[0]["price_per_gpu_hour_minor"] = 250
    job = client.get("/v1/jobs/job-a/goodput", headers=operator).json()
    r = client.get(
        "/v1/tenants/acme/goodput",
        params={"from": "2020-01-01T00:00:00Z", "to": "2100-01-01T00:00:00Z"},
        headers=operator,
    )
    assert r.status_code == 200, r.text
    t = r.json()
    assert [j["job_id"] for j in t["jobs"]] == ["job-a"]
    assert t["gpu_seconds_allocated"] == job["gpu_seconds_allocated"]
    assert t["gpu_seconds_lost"] == job["gpu_seconds_lost"]
    assert t["incidents"] == len(job["incidents"])
    sent = canned.last("scheduler", "tenant_goodput")
    assert sent["tenant"] == "acme"
    # the last ask is the term's: cut to the contract's term, priced at its price
    (term,) = t["terms"]
    assert term["contract_id"] == "ctr-a"
    assert sent["from"] == term["term_start"]
    assert sent["price_per_gpu_hour_minor"] == 250
    assert term["gpu_seconds_allocated"] == job["gpu_seconds_allocated"]
    assert term["counterfactual"]["money_saved_minor"] == job["counterfactual"]["money_saved_minor"]
    assert (
        client.get(
            "/v1/tenants/acme/goodput", params={"from": "1700000000"}, headers=operator
        ).status_code
        == 422
    )
