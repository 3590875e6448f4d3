"""Parsed deployment files, loaded once per test session (they are only read)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.deploy import checks


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = checks.load_yaml(checks.COMPOSE_FILE)
    return data


@pytest.fixture(scope="session")
def k8s_docs() -> list[dict[str, Any]]:
    return checks.k8s_documents(checks.K8S_DIR)


@pytest.fixture(scope="session")
def kustomization() -> dict[str, Any]:
    data: dict[str, Any] = checks.load_yaml(checks.K8S_DIR / "kustomization.yaml")
    return data


@pytest.fixture(scope="session")
def known_env() -> frozenset[str]:
    return checks.known_env_names()
