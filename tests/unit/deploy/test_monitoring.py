"""The Prometheus and Grafana files against the code: scrape targets, provisioning, and
every dashboard query naming series the services export (tests.unit.deploy.monitoring)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.api.state import ApiState
from tests.unit.deploy import checks, monitoring
from torchrelay.contract import SERVICES
from torchrelay.observability import ServiceMetrics


@pytest.fixture(scope="module")
def compose_config() -> dict[str, Any]:
    data: dict[str, Any] = checks.load_yaml(monitoring.PROMETHEUS_COMPOSE_CONFIG)
    return data


@pytest.fixture(scope="module")
def k8s_config(k8s_docs: list[dict[str, Any]]) -> dict[str, Any]:
    return monitoring.k8s_prometheus_config(k8s_docs)


@pytest.fixture(scope="module")
def jobs(
    compose: dict[str, Any],
    compose_config: dict[str, Any],
    k8s_docs: list[dict[str, Any]],
    kustomization: dict[str, Any],
    k8s_config: dict[str, Any],
) -> frozenset[str]:
    compose_targets, _ = monitoring.compose_scrape_targets(compose, compose_config)
    k8s_targets, _ = monitoring.k8s_scrape_targets(k8s_docs, kustomization["namespace"], k8s_config)
    return frozenset(t.job for t in [*compose_targets, *k8s_targets])


# ------------------------------------------------------------- what is exported


def test_the_code_scan_finds_every_metric_the_shared_registries_build() -> None:
    """The scanner is not blind: what ServiceMetrics and the api's ApiState really register
    (instantiated here) is all among the series it reads off the code."""
    exported = monitoring.exported_series()
    for registry in (ServiceMetrics("probe").registry, ApiState().metrics.registry):
        for family in registry.collect():
            for sample in family.samples:
                assert sample.name in exported, sample.name
    # And each service's own metrics: one of each is found with its owner.
    owned = {
        "detector_faults_total": "detector",
        "torchrelay_nodes": "detector",
        "incidents_total": "scheduler",
        "migration_stall_seconds_bucket": "scheduler",
        "spares_available": "spare_pool",
        "torchrelay_migrations_total": "migration_executor",
        "torchrelay_guarantee_ratio": "billing",
        "torchrelay_http_request_seconds_bucket": "api",
    }
    for name, service in owned.items():
        assert exported[name].services == {service}, (name, exported[name])
    assert exported["torchrelay_rpc_seconds_bucket"].services == set(SERVICES)


def test_the_api_serves_what_the_scan_says_it_exports() -> None:
    _, _, text = monitoring.api_get("/metrics")
    exported = monitoring.exported_series()
    served = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert served, "the api's /metrics returned no samples"
    assert served <= set(exported), served - set(exported)


# ----------------------------------------------------------------- Prometheus


def test_compose_prometheus_scrapes_every_service_on_its_metrics_port(
    compose: dict[str, Any], compose_config: dict[str, Any]
) -> None:
    targets, problems = monitoring.compose_scrape_targets(compose, compose_config)
    assert problems == []
    assert monitoring.coverage_problems("prometheus.yml", targets) == []
    assert {t.port for t in targets} == {8080}


def test_k8s_prometheus_finds_every_service_pod_on_its_metrics_port(
    k8s_docs: list[dict[str, Any]], kustomization: dict[str, Any], k8s_config: dict[str, Any]
) -> None:
    targets, problems = monitoring.k8s_scrape_targets(
        k8s_docs, kustomization["namespace"], k8s_config
    )
    assert problems == []
    assert monitoring.coverage_problems("prometheus-config", targets) == []
    # One target per service pod template: the agent, NATS and Redis are not scraped.
    assert sorted(t.module for t in targets) == sorted(f"services.{s}" for s in SERVICES)


def test_compose_and_kubernetes_name_each_services_job_alike(
    compose: dict[str, Any],
    compose_config: dict[str, Any],
    k8s_docs: list[dict[str, Any]],
    kustomization: dict[str, Any],
    k8s_config: dict[str, Any],
) -> None:
    compose_targets, _ = monitoring.compose_scrape_targets(compose, compose_config)
    k8s_targets, _ = monitoring.k8s_scrape_targets(k8s_docs, kustomization["namespace"], k8s_config)
    compose_jobs = monitoring.jobs_by_module(compose_targets)
    assert compose_jobs == monitoring.jobs_by_module(k8s_targets)
    assert len(compose_jobs) == len(SERVICES)


def test_compose_runs_prometheus_and_grafana_with_the_repositorys_files(
    compose: dict[str, Any],
) -> None:
    assert monitoring.compose_monitoring_problems(compose) == []
    for name in ("prometheus", "grafana"):
        assert compose["services"][name]["profiles"] == ["monitoring"], name


def test_grafana_provisioning_is_what_grafana_reads(compose: dict[str, Any]) -> None:
    assert monitoring.provisioning_problems(compose) == []


def test_the_k8s_prometheus_config_is_in_the_base() -> None:
    resources = checks.load_yaml(checks.K8S_DIR / "kustomization.yaml")["resources"]
    assert "prometheus.yaml" in resources


# -------------------------------------------------------------------- Grafana


def test_every_panel_queries_only_series_the_services_export(jobs: frozenset[str]) -> None:
    boards = monitoring.load_dashboards()
    problems = monitoring.dashboards_problems(
        boards, monitoring.exported_series(), jobs, monitoring.provisioned_uids()
    )
    assert problems == []


def test_the_dashboards_cover_what_operators_watch() -> None:
    """Fleet health, spare depth per domain, migrations and stalls, the guarantee per
    contract and control-plane latency each have panels over their metrics."""
    queried: set[str] = set()
    for board in monitoring.load_dashboards().values():
        for panel in monitoring._panels(board):
            for target in panel.get("targets") or []:
                queried |= {s.metric for s in monitoring.parse_promql(target["expr"]).selectors}
    assert {
        "torchrelay_nodes",
        "torchrelay_gpus",
        "spares_available",
        "incidents_total",
        "torchrelay_migrations_total",
        "migration_stall_seconds_bucket",
        "torchrelay_guarantee_ratio",
        "torchrelay_guarantee_threshold",
        "torchrelay_handler_seconds_bucket",
        "torchrelay_rpc_seconds_bucket",
        "torchrelay_http_request_seconds_bucket",
    } <= queried


@pytest.mark.parametrize(
    ("expr", "metrics", "grouping"),
    [
        (
            'histogram_quantile(0.99, sum by (le, verb) (rate(x_bucket{service=~"$s"}[5m])))',
            ["x_bucket"],
            {"le", "verb"},
        ),
        ("a < on (c, t) b", ["a", "b"], {"c", "t"}),
        (
            "sum(rate(a_total[$__rate_interval])) / sum(rate(b_count[1m] offset 5m))",
            ["a_total", "b_count"],
            set(),
        ),
        ('max by (cluster) (m{health=~"a|b"}) > bool 0', ["m"], {"cluster"}),
    ],
)
def test_the_promql_reader_finds_each_selector_and_label(
    expr: str, metrics: list[str], grouping: set[str]
) -> None:
    parsed = monitoring.parse_promql(expr)
    assert parsed.problems == ()
    assert [s.metric for s in parsed.selectors] == metrics
    assert parsed.grouping == grouping


# ------------------------------------------------------- the checks can fail
# Each test breaks one thing in a copy of the real files and asserts the check names it.


def _find(problems: list[str], *fragments: str) -> list[str]:
    return [p for p in problems if all(f in p for f in fragments)]


def _board_problems(board: dict[str, Any], jobs: frozenset[str]) -> list[str]:
    return monitoring.dashboard_problems(
        "copy.json", board, monitoring.exported_series(), jobs, monitoring.provisioned_uids()
    )


def _first_query(board: dict[str, Any]) -> dict[str, Any]:
    panel = next(p for p in monitoring._panels(board) if p.get("targets"))
    target: dict[str, Any] = panel["targets"][0]
    return target


@pytest.mark.parametrize(
    ("expr", "fragments"),
    [
        # A typo, a histogram without its series suffix, a counter without _total.
        ("sum(torchrelay_nodez)", ["torchrelay_nodez", "exported by no"]),
        ("rate(torchrelay_handler_seconds[5m])", ["torchrelay_handler_seconds ", "exported"]),
        ("rate(incidents[5m])", ["incidents ", "exported by no"]),
        ('spares_available{domain="d"}', ["spares_available has no label 'domain'"]),
        ("sum by (tenant) (spares_available)", ["groups by 'tenant'"]),
        ('up{job="spare_pool"}', ["job 'spare_pool'"]),
        (
            "histogram_quantil(0.9, sum by (le) (rate(incidents_total[5m])))",
            ["histogram_quantil()"],
        ),
        ('spares_available{cluster=~"$region"}', ["$region is no variable"]),
        ('{cluster="a"}', ["without a metric name"]),
    ],
)
def test_the_dashboard_check_names_a_query_that_asks_for_what_is_not_exported(
    jobs: frozenset[str], expr: str, fragments: list[str]
) -> None:
    board = copy.deepcopy(monitoring.load_dashboards()["torchrelay-fleet.json"])
    assert _board_problems(board, jobs) == []
    _first_query(board)["expr"] = expr
    problems = _board_problems(board, jobs)
    assert _find(problems, *fragments), problems


def test_the_dashboard_check_names_layout_ids_legends_and_datasources(
    jobs: frozenset[str],
) -> None:
    board = copy.deepcopy(monitoring.load_dashboards()["torchrelay-migrations.json"])
    panels = [p for p in monitoring._panels(board) if p.get("targets")]
    panels[0]["gridPos"]["x"] = 20  # w 12: past the 24 columns
    panels[1]["id"] = panels[2]["id"]
    panels[3]["targets"][0]["legendFormat"] = "{{reslution}}"
    panels[4]["datasource"] = {"type": "loki", "uid": "logs"}
    board["templating"]["list"].append(
        {
            "name": "x",
            "type": "query",
            "datasource": panels[5]["datasource"],
            "query": "label_values(nope, a)",
        }
    )
    problems = _board_problems(board, jobs)
    assert _find(problems, "does not fit")
    assert _find(problems, "panel ids", "not unique")
    assert _find(problems, "legend shows 'reslution'")
    assert _find(problems, "loki")
    assert _find(problems, "variable x", "nope", "exported by no")


def test_the_code_scan_refuses_what_it_cannot_read_and_owns_only_services(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "from prometheus_client import Counter as C, Gauge\n"
        "import prometheus_client as pc\n"
        "NAME = 'x'\n"
        "a = C(NAME, 'doc')\n"
        "b = Gauge('fine', 'doc', LABELS)\n"
        "c = pc.Histogram('seen_seconds', 'doc', ['verb'])\n"
        "from collections import Counter\n"
    )
    definitions, problems = monitoring.metric_definitions([tmp_path])
    assert _find(problems, "m.py:4", "name is not a string literal")
    assert _find(problems, "m.py:5", "labels of fine are not literals")
    [seen] = definitions
    assert seen.kwargs["name"] == "seen_seconds"
    assert seen.services == frozenset()  # outside services/: no scraped process builds it
    assert "seen_seconds_bucket" in monitoring.series_of(seen)


def test_the_compose_scrape_check_names_a_wrong_port_host_or_missing_service(
    compose: dict[str, Any], compose_config: dict[str, Any]
) -> None:
    broken = copy.deepcopy(compose_config)
    jobs = {sc["job_name"]: sc for sc in broken["scrape_configs"]}
    jobs["api"]["static_configs"][0]["targets"] = ["api:9090"]
    jobs["billing"]["static_configs"][0]["targets"] = ["nats:8222"]
    jobs["scheduler"]["static_configs"][0]["targets"] = ["schedular:8080"]
    jobs["detector"]["metrics_path"] = "/metrix"
    targets, problems = monitoring.compose_scrape_targets(compose, broken)
    assert _find(problems, "api:9090", "TORCHRELAY_HTTP_PORT=8080")
    assert _find(problems, "nats:8222", "runs no torchrelay service")
    assert _find(problems, "schedular", "no service of docker-compose.yml")
    assert _find(problems, "services.detector serves no Prometheus metrics at /metrix")
    coverage = monitoring.coverage_problems("copy", targets)
    assert _find(coverage, "services.billing", "not one")


def test_the_k8s_scrape_check_runs_the_relabelling_over_the_pods(
    k8s_docs: list[dict[str, Any]], kustomization: dict[str, Any], k8s_config: dict[str, Any]
) -> None:
    namespace = kustomization["namespace"]
    docs = copy.deepcopy(k8s_docs)
    billing = next(
        d for d in docs if d.get("kind") == "Deployment" and d["metadata"]["name"] == "billing"
    )
    billing["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = "9000"
    agent = next(d for d in docs if d.get("kind") == "DaemonSet")
    agent["spec"]["template"]["metadata"]["annotations"] = {"prometheus.io/scrape": "true"}
    agent["spec"]["template"]["spec"]["containers"][0]["ports"] = [
        {"name": "http", "containerPort": 8080}
    ]
    targets, problems = monitoring.k8s_scrape_targets(docs, namespace, k8s_config)
    assert _find(problems, "Deployment/billing", "port 9000", "TORCHRELAY_HTTP_PORT=8080")
    assert _find(problems, "DaemonSet/detector-agent", "runs no torchrelay service")

    config = copy.deepcopy(k8s_config)
    rules = config["scrape_configs"][0]["relabel_configs"]
    config["scrape_configs"][0]["relabel_configs"] = [
        r for r in rules if r.get("target_label") != "job"
    ]
    targets, problems = monitoring.k8s_scrape_targets(k8s_docs, namespace, config)
    assert problems == []
    assert _find(monitoring.coverage_problems("copy", targets), "job torchrelay scrapes")

    config = copy.deepcopy(k8s_config)
    config["scrape_configs"][0]["kubernetes_sd_configs"][0]["namespaces"]["names"] = ["prod"]
    _, problems = monitoring.k8s_scrape_targets(k8s_docs, namespace, config)
    assert _find(problems, "['prod']", namespace)


def test_the_monitoring_compose_check_names_wrong_mounts_and_datasource(
    compose: dict[str, Any],
) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["prometheus"]["volumes"][0] = (
        "./prometheus.yml:/etc/prometheus/prometheus.yml:ro"
    )
    broken["services"]["grafana"]["volumes"][1] = "./deploy/grafana/dashboards:/dashboards:ro"
    command = broken["services"]["prometheus"]["command"]
    broken["services"]["prometheus"]["command"] = [
        "--web.listen-address=:9091" if a.startswith("--web.listen-address") else a for a in command
    ]
    problems = monitoring.compose_monitoring_problems(broken)
    assert _find(problems, "--config.file")
    assert _find(problems, "/etc/grafana/dashboards/torchrelay")
    assert _find(monitoring.provisioning_problems(broken), "not the compose Prometheus")


def test_the_relabel_simulation_follows_prometheus_semantics() -> None:
    labels = {"__address__": "10.0.0.1:80", "__meta_port": "8080", "keepme": "a"}
    rules = [
        {"source_labels": ["keepme"], "regex": "a|b", "action": "keep"},
        {
            "source_labels": ["__address__", "__meta_port"],
            "regex": r"([^:]+)(?::\d+)?;(\d+)",
            "replacement": "$1:${2}",
            "target_label": "__address__",
        },
        # No match: nothing changes; an empty result deletes the label.
        {"source_labels": ["keepme"], "regex": "z", "target_label": "keepme", "replacement": "q"},
        {"source_labels": ["missing"], "target_label": "keepme"},
    ]
    out, problems = monitoring.relabel(labels, rules)
    assert problems == []
    assert out is not None
    assert out["__address__"] == "10.0.0.1:8080"
    assert "keepme" not in out
    # keep is anchored: "ab" does not match "a|b".
    assert monitoring.relabel({"keepme": "ab"}, rules[:1])[0] is None
