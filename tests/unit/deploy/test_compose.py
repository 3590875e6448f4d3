"""docker-compose.yml against the code: commands, settings, ports, durability, profiles."""

from __future__ import annotations

import os
import re
import secrets
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.unit.deploy import checks
from torchrelay.contract import SERVICES
from torchrelay.settings import SettingsError, load_settings


def _service_running(compose: dict[str, Any], module: str) -> tuple[str, list[str]]:
    for name, svc in compose["services"].items():
        argv = checks.as_argv(svc.get("command"))
        if argv[1:3] == ["-m", module] and len(argv) == 3:
            return name, argv
    pytest.fail(f"docker-compose.yml: no service runs `python -m {module}`")


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_runs_the_command_torchrelay_up_runs(
    compose: dict[str, Any], service: str
) -> None:
    _, argv = _service_running(compose, f"services.{service}")
    up_argv = checks.up_service_argv(service)
    assert argv == ["python", *up_argv[1:]], (argv, up_argv)
    assert checks.entry_point_problem(argv) is None, checks.entry_point_problem(argv)


def test_every_command_is_an_entry_point(compose: dict[str, Any]) -> None:
    problems = [
        f"{name}: {checks.entry_point_problem(checks.as_argv(svc.get('command')))}"
        for name, svc in checks.compose_torchrelay_services(compose).items()
        if checks.entry_point_problem(checks.as_argv(svc.get("command")))
    ]
    assert problems == []


def test_services_share_one_image_env_ports_and_readyz_healthchecks(
    compose: dict[str, Any], known_env: frozenset[str]
) -> None:
    assert checks.compose_problems(compose, known_env) == []


def test_services_reach_the_compose_nats_and_redis(compose: dict[str, Any]) -> None:
    assert checks.compose_url_problems(compose) == []


def test_nats_runs_jetstream_with_fsync_always_from_the_mounted_config(
    compose: dict[str, Any],
) -> None:
    nats = compose["services"]["nats"]
    argv = checks.as_argv(nats["command"])
    config_path = argv[argv.index("--config") + 1]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in nats["volumes"]}
    assert mounts[config_path] == "./deploy/nats/nats.conf"
    text = checks.NATS_CONF.read_text()
    assert checks.nats_conf_problems("deploy/nats/nats.conf", text) == []
    assert checks.nats_conf_summary(text)["sync_interval"] == "always"
    store = checks.nats_conf_summary(text)["store_dir"]
    assert any(
        store.startswith(m.split(":")[1]) for m in nats["volumes"] if not m.startswith(".")
    ), f"JetStream store_dir {store} is not on a volume"
    assert checks.nats_conf_variables(text) <= set(checks.compose_env(nats))


def test_redis_runs_with_the_embedded_aof_flags_on_a_volume(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    argv = checks.as_argv(redis["command"])
    assert argv[0] == "redis-server"
    assert checks.redis_durability_problems("compose redis", argv) == []
    assert checks.embedded_redis_durability()["--appendfsync"] == "always"
    data_dir = argv[argv.index("--dir") + 1]
    assert any(m.split(":")[1] == data_dir for m in redis["volumes"])


def test_otel_collector_is_an_optional_profile_the_services_can_point_at(
    compose: dict[str, Any],
) -> None:
    collector = compose["services"]["otel-collector"]
    assert collector["profiles"] == ["otel"]
    config_arg = next(a for a in checks.as_argv(collector["command"]) if a.startswith("--config"))
    mounts = {m.split(":")[1]: m.split(":")[0] for m in collector["volumes"]}
    assert mounts[config_arg.split("=", 1)[1]] == "./deploy/otel-collector.yaml"

    otel = checks.load_yaml(checks.OTEL_CONF)
    http_endpoint = otel["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    http_port = int(http_endpoint.rsplit(":", 1)[1])
    traces = otel["service"]["pipelines"]["traces"]
    assert "otlp" in traces["receivers"]
    assert set(traces["exporters"]) <= set(otel["exporters"])
    assert set(traces.get("processors", [])) <= set(otel.get("processors", {}))

    # The endpoint the example .env gives the services is this collector's OTLP/HTTP traces URL.
    example = checks.COMPOSE_ENV_EXAMPLE.read_text()
    match = re.search(r"TORCHRELAY_OTLP_ENDPOINT=(\S+)", example)
    assert match, "deploy/compose.env.example does not show TORCHRELAY_OTLP_ENDPOINT"
    url = urlsplit(match.group(1))
    assert (url.hostname, url.port, url.path) == ("otel-collector", http_port, "/v1/traces")
    assert re.search(r"COMPOSE_PROFILES=otel", example)
    for name, svc in checks.compose_torchrelay_services(compose).items():
        assert "TORCHRELAY_OTLP_ENDPOINT" in checks.compose_env(svc), name


def test_required_secrets_are_in_the_env_example_as_placeholders(compose: dict[str, Any]) -> None:
    required = set(re.findall(r"\$\{([A-Z_]+):\?", checks.COMPOSE_FILE.read_text()))
    assert required >= {
        "REDIS_PASSWORD",
        "TORCHRELAY_OPERATOR_TOKEN",
        *(f"REDIS_{s.upper()}_PASSWORD" for s in SERVICES),
    }
    example = dict(
        line.split("=", 1)
        for line in checks.COMPOSE_ENV_EXAMPLE.read_text().splitlines()
        if line and not line.startswith("#")
    )
    for var in required:
        assert var in example, f"{var} is required by docker-compose.yml but not in the example"
        assert checks.PLACEHOLDER in example[var], f"{var} in the example is not a placeholder"


def test_detector_agent_runs_in_agent_mode_under_the_gpu_profile(compose: dict[str, Any]) -> None:
    agent = compose["services"]["detector-agent"]
    argv = checks.as_argv(agent["command"])
    assert argv[:4] == ["python", "-m", "services.detector", "agent"]
    assert agent["profiles"] == ["gpu"]


def test_every_service_environment_loads_its_settings_class(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a filled-in .env, each service's environment is valid for the settings class its
    process loads, in production mode; with the example's placeholders the api refuses."""
    variables = {
        "REDIS_PASSWORD": secrets.token_urlsafe(24),
        "TORCHRELAY_OPERATOR_TOKEN": secrets.token_urlsafe(24),
        **{f"REDIS_{s.upper()}_PASSWORD": secrets.token_urlsafe(24) for s in SERVICES},
    }
    for name, svc in checks.compose_torchrelay_services(compose).items():
        argv = checks.as_argv(svc.get("command"))
        env = checks.compose_resolved_env(checks.compose_env(svc), variables)
        with monkeypatch.context() as m:
            for key in [k for k in os.environ if k.startswith("TORCHRELAY_")]:
                m.delenv(key)
            for key, value in env.items():
                m.setenv(key, value)
            settings = load_settings(checks.settings_class_for(argv))
        assert settings.environment == "production", name
        # Its own NATS user: the file of the secret it mounts as nats.creds.
        assert str(settings.nats_credentials) == "/run/secrets/nats.creds", name
        mounted = {
            (m["target"] if isinstance(m, dict) else m): (m["source"] if isinstance(m, dict) else m)
            for m in svc.get("secrets") or []
        }
        assert "nats.creds" in mounted, name
        role = "node_agent" if argv[3:4] == ["agent"] else argv[2].split(".")[1]
        assert compose["secrets"][mounted["nats.creds"]]["file"] == f"./secrets/{role}.cred"
        if argv[3:4] != ["agent"]:
            # Its own Redis ACL user.
            assert settings.redis_url.startswith(f"redis://{role}:"), name
            assert variables[f"REDIS_{role.upper()}_PASSWORD"] in settings.redis_url, name

    example = dict(
        line.split("=", 1)
        for line in checks.COMPOSE_ENV_EXAMPLE.read_text().splitlines()
        if line and not line.startswith("#")
    )
    api_env = checks.compose_resolved_env(checks.compose_env(compose["services"]["api"]), example)
    for key, value in api_env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SettingsError, match="TORCHRELAY_OPERATOR_TOKEN"):
        load_settings(checks.settings_class_for(["python", "-m", "services.api"]))


def test_jetstream_is_provisioned_by_admin_before_any_service_starts(
    compose: dict[str, Any],
) -> None:
    """Only ``admin`` may administer JetStream: a one-shot ``torchrelay provision`` with the
    admin credential runs first, and every service waits for it to succeed."""
    services = compose["services"]
    job = services["provision"]
    assert checks.is_cli_job(job)
    argv = checks.as_argv(job["command"])
    assert argv[3] == "provision"
    assert checks.cli_job_problem(argv) is None
    mounted = {s["source"]: s["target"] for s in job["secrets"]}
    assert mounted == {"nats_admin": "nats.creds"}
    assert compose["secrets"]["nats_admin"]["file"].endswith("/admin.cred")
    assert job["environment"]["TORCHRELAY_NATS_CREDENTIALS"] == "/run/secrets/nats.creds"
    for name, svc in checks.compose_torchrelay_services(compose).items():
        condition = (svc.get("depends_on") or {}).get("provision", {}).get("condition")
        if name != "detector-agent":  # GPU hosts' telemetry only: no JetStream
            assert condition == "service_completed_successfully", name
        sources = {s["source"] if isinstance(s, dict) else s for s in svc.get("secrets", [])}
        assert "nats_admin" not in sources, name
    sched = {s["source"]: s["target"] for s in services["scheduler"]["secrets"]}
    revoker = services["scheduler"]["environment"]["TORCHRELAY_NATS_REVOKER_CREDENTIALS"]
    assert revoker == f"/run/secrets/{sched['nats_revoker']}"


def test_the_cli_job_check_catches_a_bad_verb() -> None:
    assert checks.cli_job_problem(["python", "-m", "torchrelay.cli", "provison"])
    assert checks.cli_job_problem(["python", "-m", "torchrelay.cli", "provision"]) is None
