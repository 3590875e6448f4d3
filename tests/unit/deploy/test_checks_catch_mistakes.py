"""The checkers must be able to fail: each test breaks one thing in a copy of the real
files and asserts that the checker names it."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.unit.deploy import checks


def _find(problems: list[str], *fragments: str) -> list[str]:
    return [p for p in problems if all(f in p for f in fragments)]


def _container(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for d in docs:
        if d["kind"] in checks.WORKLOAD_KINDS and d["metadata"]["name"] == name:
            container: dict[str, Any] = d["spec"]["template"]["spec"]["containers"][0]
            return container
    raise KeyError(name)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["python", "-m", "services.nope"], "not a service module"),
        (["python", "-m", "services.billing", "--port", "1"], "unexpected arguments"),
        (["torchrelay", "frobnicate"], "not a torchrelay subcommand"),
        (["gunicorn", "services.api"], "neither"),
        (["python", "-m", "services.detector", "agent", "--node", "n"], "--backend"),
        (
            ["python", "-m", "services.detector", "agent", "--node", "n", "--backend", "cuda"],
            "no backend",
        ),
    ],
)
def test_entry_point_checker_rejects_what_is_no_entry_point(argv: list[str], fragment: str) -> None:
    problem = checks.entry_point_problem(argv)
    assert problem is not None
    assert fragment in problem, problem
    assert checks.entry_point_problem(["torchrelay", "up"]) is None


def test_compose_checker_catches_a_port_typo_and_a_missing_service(
    compose: dict[str, Any], known_env: frozenset[str]
) -> None:
    broken = copy.deepcopy(compose)
    api_env = broken["services"]["api"]["environment"]
    api_env["TORCHRELAY_HTTP_PORT"] = "9090"  # still publishes 8080:8080
    api_env["TORCHRELAY_HTTP_PROT"] = "9090"
    del broken["services"]["billing"]
    broken["services"]["scheduler"]["healthcheck"]["test"] = ["CMD", "true"]
    problems = checks.compose_problems(broken, known_env)
    assert _find(problems, "service api", "container port 8080", "9090")
    assert _find(problems, "TORCHRELAY_HTTP_PROT", "no torchrelay settings class")
    assert _find(problems, "services.billing")
    assert _find(problems, "service scheduler", "/readyz")
    assert checks.compose_problems(compose, known_env) == []


def test_compose_checker_catches_a_url_to_the_wrong_host(compose: dict[str, Any]) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["billing"]["environment"] = dict(
        broken["services"]["billing"]["environment"], REDIS_URL="redis://localhost:6379/0"
    )
    assert _find(checks.compose_url_problems(broken), "billing", "REDIS_URL")


def test_k8s_checker_catches_probe_port_and_image_mismatches(
    k8s_docs: list[dict[str, Any]], known_env: frozenset[str], kustomization: dict[str, Any]
) -> None:
    broken = copy.deepcopy(k8s_docs)
    scheduler = _container(broken, "scheduler")
    scheduler["readinessProbe"]["httpGet"]["path"] = "/healthz"
    scheduler["ports"][0]["containerPort"] = 9000
    _container(broken, "billing")["image"] = "torchrelay/torchrelay:latest"
    _container(broken, "detector-agent")["command"][5] = "$(NODE_NAM)"
    problems = checks.k8s_problems(broken, known_env, kustomization)
    assert _find(problems, "Deployment/scheduler", "readinessProbe", "/readyz")
    assert _find(problems, "Deployment/scheduler", "containerPort")
    assert _find(problems, "Deployment/billing", "image")
    assert _find(problems, "detector-agent", "$(NODE_NAM)")
    assert checks.k8s_problems(k8s_docs, known_env, kustomization) == []


def test_k8s_checker_catches_a_real_secret_and_a_secret_in_the_configmap(
    k8s_docs: list[dict[str, Any]],
) -> None:
    broken = copy.deepcopy(k8s_docs)
    secret = next(d for d in broken if d["kind"] == "Secret")
    secret["stringData"]["redis-password"] = "hunter2hunter2hunter2"
    config = next(
        d
        for d in broken
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "torchrelay-config"
    )
    config["data"]["TORCHRELAY_OPERATOR_TOKEN"] = "x"
    config["data"]["NATS_URL"] = "nats://user:pw@nats:4222"
    problems = checks.k8s_secret_problems(broken)
    assert _find(problems, "redis-password", "placeholder")
    assert _find(problems, "TORCHRELAY_OPERATOR_TOKEN", "looks like a secret")
    assert _find(problems, "NATS_URL", "password in a URL")


def test_k8s_checker_catches_lost_durability(k8s_docs: list[dict[str, Any]]) -> None:
    broken = copy.deepcopy(k8s_docs)
    nats_config = next(
        d for d in broken if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nats-config"
    )
    nats_config["data"]["nats.conf"] = nats_config["data"]["nats.conf"].replace(
        "sync_interval: always", "sync_interval: 2m"
    )
    next(d for d in broken if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "nats")[
        "spec"
    ]["replicas"] = 5
    redis = _container(broken, "redis")
    redis["args"][redis["args"].index("always")] = "everysec"
    nats_problems = checks.k8s_nats_problems(broken)
    assert _find(nats_problems, "sync_interval", "'2m'")
    assert _find(nats_problems, "5 replicas")
    assert _find(nats_problems, "routes")
    assert _find(nats_problems, "TORCHRELAY_STREAM_REPLICAS=3", "5 servers")
    assert _find(checks.k8s_redis_problems(broken), "--appendfsync", "'everysec'")


def test_k8s_checker_catches_an_unmounted_credentials_file_and_a_wrong_target_port(
    k8s_docs: list[dict[str, Any]],
) -> None:
    broken = copy.deepcopy(k8s_docs)
    _container(broken, "spare-pool")["volumeMounts"][0]["mountPath"] = "/etc/nats"
    api_service = next(
        d for d in broken if d["kind"] == "Service" and d["metadata"]["name"] == "api"
    )
    api_service["spec"]["ports"][0]["targetPort"] = "metrics"
    assert _find(
        checks.k8s_credentials_mount_problems(broken), "spare-pool", "TORCHRELAY_NATS_CREDENTIALS"
    )
    assert _find(checks.k8s_service_problems(broken), "Service/api", "targetPort")


def test_kustomization_checker_catches_a_missing_and_an_unlisted_manifest(tmp_path: Path) -> None:
    kdir = tmp_path / "kubernetes"
    shutil.copytree(checks.K8S_DIR, kdir)
    text = (kdir / "kustomization.yaml").read_text()
    (kdir / "kustomization.yaml").write_text(
        text.replace("  - billing.yaml\n", "  - biling.yaml\n")
    )
    problems = checks.kustomization_problems(kdir)
    assert _find(problems, "biling.yaml", "does not exist")
    assert _find(problems, "billing.yaml", "not in kustomization.yaml")
