"""deploy/kubernetes/ (a kustomize base) against the code; kustomize itself is not installed,
so the resources are read as listed in kustomization.yaml."""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.unit.deploy import checks
from torchrelay.auth import ensure_bundle
from torchrelay.contract import SERVICES
from torchrelay.runtime import find_nats_server
from torchrelay.settings import SettingsError, load_settings


def test_kustomization_lists_every_manifest_and_each_parses() -> None:
    assert checks.kustomization_problems(checks.K8S_DIR) == []


def test_every_workload_selects_its_own_pods(k8s_docs: list[dict[str, Any]]) -> None:
    assert checks.selector_problems(k8s_docs) == []


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_is_a_deployment_running_what_torchrelay_up_runs(
    k8s_docs: list[dict[str, Any]], service: str
) -> None:
    commands = [
        checks.as_argv(c.get("command")) + checks.as_argv(c.get("args"))
        for _, wl, c in checks.k8s_torchrelay_containers(k8s_docs)
        if wl["kind"] == "Deployment"
    ]
    up_argv = checks.up_service_argv(service)
    assert ["python", *up_argv[1:]] in commands, f"no Deployment runs {up_argv[1:]}"
    argv = ["python", *up_argv[1:]]
    assert checks.entry_point_problem(argv) is None, checks.entry_point_problem(argv)


def test_every_container_command_is_an_entry_point(k8s_docs: list[dict[str, Any]]) -> None:
    problems = []
    for where, _, c in checks.k8s_torchrelay_containers(k8s_docs):
        problem = checks.entry_point_problem(
            checks.as_argv(c.get("command")) + checks.as_argv(c.get("args"))
        )
        if problem:
            problems.append(f"{where}: {problem}")
    assert problems == []


def test_images_env_ports_and_probes_agree_with_the_settings(
    k8s_docs: list[dict[str, Any]], known_env: frozenset[str], kustomization: dict[str, Any]
) -> None:
    assert checks.k8s_problems(k8s_docs, known_env, kustomization) == []


def test_services_select_pods_and_the_api_is_reachable(k8s_docs: list[dict[str, Any]]) -> None:
    assert checks.k8s_service_problems(k8s_docs) == []


def test_secret_has_placeholders_only_and_configmap_no_secrets(
    k8s_docs: list[dict[str, Any]],
) -> None:
    assert checks.k8s_secret_problems(k8s_docs) == []


def test_nats_credentials_file_is_mounted_where_the_setting_says(
    k8s_docs: list[dict[str, Any]],
) -> None:
    assert checks.k8s_credentials_mount_problems(k8s_docs) == []


def test_nats_is_a_three_server_jetstream_cluster_with_r3_and_fsync_always(
    k8s_docs: list[dict[str, Any]],
) -> None:
    assert checks.k8s_nats_problems(k8s_docs) == []


def test_redis_is_one_primary_with_aof_always_on_a_volume(k8s_docs: list[dict[str, Any]]) -> None:
    assert checks.k8s_redis_problems(k8s_docs) == []


def test_the_placeholder_operator_token_is_refused_in_production(
    k8s_docs: list[dict[str, Any]],
) -> None:
    from services.api.settings import operator_token_problem

    secret = next(d for d in k8s_docs if d["kind"] == "Secret")
    problem = operator_token_problem(secret["stringData"]["operator-token"])
    assert problem is not None
    assert "placeholder" in problem


@pytest.mark.parametrize("config", ["compose", "kubernetes"])
def test_nats_server_accepts_the_configuration(
    k8s_docs: list[dict[str, Any]], tmp_path: Path, config: str
) -> None:
    """The real nats-server (the one `torchrelay up` runs) parses each config (-t)."""
    if config == "compose":
        text = checks.NATS_CONF.read_text()
    else:
        text = next(
            d
            for d in k8s_docs
            if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nats-config"
        )["data"]["nats.conf"]
    conf = tmp_path / "nats.conf"
    conf.write_text(text)
    # The authorization block it includes, as `torchrelay auth init` writes it.
    bundle = ensure_bundle(tmp_path / "generated")
    (tmp_path / "auth").mkdir()
    (tmp_path / "auth" / "nats-auth.conf").write_text(bundle.nats_conf_path.read_text())
    assert 'include "auth/nats-auth.conf"' in text
    env = {"POD_NAME": "nats-0", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [str(find_nats_server()), "-c", str(conf), "-t"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _random_secrets(k8s_docs: list[dict[str, Any]]) -> dict[str, str]:
    secret = next(d for d in k8s_docs if d["kind"] == "Secret")
    return {k: secrets.token_urlsafe(24) for k in secret["stringData"]}


def c_volumes(docs: list[dict[str, Any]], container: dict[str, Any]) -> list[dict[str, Any]]:
    """The volumes of the pod that runs ``container``, that it mounts."""
    for _where, wl, c in checks.k8s_torchrelay_containers(docs):
        if c is container:
            mounted = {m["name"] for m in c.get("volumeMounts") or []}
            spec = wl["spec"]["template"]["spec"]
            return [v for v in spec.get("volumes") or [] if v["name"] in mounted]
    return []


def test_every_container_environment_loads_its_settings_class(
    k8s_docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With real secret values, each container's environment is valid for the settings class
    its process loads, in production mode (so the deployment starts)."""
    values = _random_secrets(k8s_docs)
    for where, _, c in checks.k8s_torchrelay_containers(k8s_docs):
        argv = checks.as_argv(c.get("command")) + checks.as_argv(c.get("args"))
        env = checks.k8s_resolved_env(k8s_docs, c, values)
        cls = checks.settings_class_for(argv)
        with monkeypatch.context() as m:
            for key in [k for k in os.environ if k.startswith("TORCHRELAY_")]:
                m.delenv(key)
            for key, value in env.items():
                m.setenv(key, value)
            settings = load_settings(cls)
        assert settings.environment == "production", where
        assert settings.stream_replicas == 3, where
        if argv[3:4] == ["agent"]:
            continue
        # Its own Redis ACL user, and its own NATS user (the Secret key it mounts).
        role = argv[2].split(".")[1]
        assert settings.redis_url.startswith(f"redis://{role}:"), where
        assert values[f"redis-{role}-password"] in settings.redis_url, where
        volumes = {v["name"]: v for v in c_volumes(k8s_docs, c)}
        keys = {
            i["key"] for v in volumes.values() for i in (v.get("secret") or {}).get("items") or []
        }
        assert f"nats-{role}.cred" in keys, where


def test_the_placeholder_secrets_do_not_start_the_api(
    k8s_docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = next(d for d in k8s_docs if d["kind"] == "Secret")
    api = next(
        c
        for _, _, c in checks.k8s_torchrelay_containers(k8s_docs)
        if checks.as_argv(c.get("command"))[2:3] == ["services.api"]
    )
    env = checks.k8s_resolved_env(k8s_docs, api, secret["stringData"])
    cls = checks.settings_class_for(["python", "-m", "services.api"])
    assert cls.__name__ == "ApiSettings"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SettingsError, match="TORCHRELAY_OPERATOR_TOKEN"):
        load_settings(cls)


def test_jetstream_is_provisioned_by_a_job_with_the_admin_credential(
    k8s_docs: list[dict[str, Any]],
) -> None:
    jobs = [d for d in k8s_docs if d.get("kind") == "Job"]
    assert [j["metadata"]["name"] for j in jobs] == ["torchrelay-provision"]
    pod = jobs[0]["spec"]["template"]["spec"]
    argv = pod["containers"][0]["command"]
    assert argv[3] == "provision"
    assert checks.cli_job_problem(argv) is None
    items = pod["volumes"][0]["secret"]["items"]
    assert items == [{"key": "nats-admin.cred", "path": "nats.creds"}]
    # No long-running workload gets the admin credential.
    for doc in k8s_docs:
        if doc.get("kind") in ("Deployment", "StatefulSet", "DaemonSet"):
            assert "nats-admin.cred" not in str(doc), doc["metadata"]["name"]
