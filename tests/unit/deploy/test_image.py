"""The Dockerfile and .dockerignore: one image, the pinned CPU torch, entry point and port."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from typing import Any

from tests.unit.deploy import checks


def _instructions() -> list[tuple[str, str]]:
    return checks.dockerfile_instructions(checks.DOCKERFILE.read_text())


def test_both_stages_are_python_3_11_slim() -> None:
    bases = [args.split()[0] for word, args in _instructions() if word == "FROM"]
    assert bases
    assert all(b == "python:3.11-slim" for b in bases), bases


def test_pip_installs_the_package_with_the_dev_constraints_and_cpu_torch() -> None:
    runs = [args for word, args in _instructions() if word == "RUN" and "pip install" in args]
    assert runs
    assert all("-c constraints/dev.txt" in r for r in runs), runs
    torch = [r for r in runs if re.search(r"\btorch\b", r)]
    assert torch
    assert "download.pytorch.org/whl/cpu" in torch[0]
    assert "torch==2.13.0" in (checks.REPO / "constraints" / "dev.txt").read_text()
    # The control plane the image runs, and the OTLP exporter (the `otel` profile).
    assert any('".[control-plane,otlp]"' in r for r in runs), runs


def test_env_names_are_settings_and_the_port_is_the_one_exposed(
    known_env: frozenset[str], compose: dict[str, Any], k8s_docs: list[dict[str, Any]]
) -> None:
    env: dict[str, str] = {}
    for word, args in _instructions():
        if word == "ENV":
            env.update(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)", args))
    assert checks.unknown_env_problems("Dockerfile", env, known_env) == []
    # The services ship inside torchrelay: the image's interpreter must find them there.
    [base] = {args for word, args in _instructions() if word == "FROM" and " AS " not in args}
    version = base.split(":")[1].split("-")[0]
    assert env["PYTHONPATH"] == (
        f"/opt/venv/lib/python{version}/site-packages/torchrelay/_control_plane"
    )
    exposed = [args for word, args in _instructions() if word == "EXPOSE"]
    assert exposed == [env["TORCHRELAY_HTTP_PORT"]]
    assert env["TORCHRELAY_HTTP_HOST"] == "0.0.0.0"
    compose_port = compose["x-torchrelay-env"]["TORCHRELAY_HTTP_PORT"]
    config = checks.configmap_data(k8s_docs, "torchrelay-config")
    k8s_port = config["TORCHRELAY_HTTP_PORT"]
    assert env["TORCHRELAY_HTTP_PORT"] == compose_port == k8s_port


def test_default_command_is_an_entry_point() -> None:
    cmd = [args for word, args in _instructions() if word == "CMD"]
    assert len(cmd) == 1
    argv = json.loads(cmd[0])  # exec form: signals reach Python, not a shell
    assert checks.entry_point_problem(argv) is None, checks.entry_point_problem(argv)


def test_everything_copied_exists_and_is_not_dockerignored() -> None:
    patterns = checks.dockerignore_patterns(checks.DOCKERIGNORE.read_text())
    sources = []
    for word, args in _instructions():
        if word == "COPY" and not args.startswith("--from"):
            sources += args.split()[:-1]
    assert sources
    for src in sources:
        assert (checks.REPO / src).exists(), f"Dockerfile copies {src}, which does not exist"
        assert not checks.is_dockerignored(src.rstrip("/"), patterns), f"{src} is dockerignored"


def test_dockerignore_keeps_secrets_and_local_state_out_of_the_build_context() -> None:
    patterns = checks.dockerignore_patterns(checks.DOCKERIGNORE.read_text())
    for path in (".env", ".git", ".venv", ".torchrelay", "libs/torchrelay/__pycache__"):
        assert checks.is_dockerignored(path, patterns), f"{path} would be sent to the build"
    assert not checks.is_dockerignored("libs/torchrelay/bus.py", patterns)


def test_image_tag_is_the_package_version_everywhere(
    compose: dict[str, Any], k8s_docs: list[dict[str, Any]], kustomization: dict[str, Any]
) -> None:
    images = {svc["image"] for svc in checks.compose_torchrelay_services(compose).values()}
    images |= {c["image"] for _, _, c in checks.k8s_torchrelay_containers(k8s_docs)}
    assert images == {checks.expected_image()}
    assert kustomization["images"] == [
        {"name": checks.IMAGE_REPOSITORY, "newTag": checks.package_version()}
    ]
    assert f"-t {checks.expected_image()}" in checks.DOCKERFILE.read_text()


def test_pip_install_dot_ships_every_module_and_data_file() -> None:
    """The image installs the package non-editable (`pip install .`): setuptools' package
    discovery skips a folder without __init__.py, and data files not in package-data."""
    project = tomllib.loads((checks.REPO / "pyproject.toml").read_text())
    package_data: dict[str, list[str]] = project["tool"]["setuptools"].get("package-data", {})
    problems = []
    for root in (checks.REPO / "libs" / "torchrelay", checks.REPO / "services"):
        for path in sorted(root.rglob("*")):
            if "__pycache__" in path.parts or path.is_dir():
                continue
            if path.suffix == ".py":
                if not (path.parent / "__init__.py").is_file():
                    problems.append(f"{path.parent.relative_to(checks.REPO)} has no __init__.py")
                continue
            if path.suffix == ".pyc":
                continue
            top = path.relative_to(root.parent).parts[0]
            key = {"services": "torchrelay._control_plane.services"}.get(top, top)
            rel = str(path.relative_to(root))
            if not any(fnmatch.fnmatch(rel, g) for g in package_data.get(key, [])):
                problems.append(f"{path.relative_to(checks.REPO)} is not in package-data")
    assert sorted(set(problems)) == []
