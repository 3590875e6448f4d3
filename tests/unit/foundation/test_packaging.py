"""The wheel: ``torchrelay`` is its only top-level name (no generic ``services`` in
site-packages); the services ride inside it with their data files, and a process run with
:func:`torchrelay.runtime.with_services_path` imports them from there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
INSIDE = "torchrelay._control_plane.services"
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]


def _listed_packages() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return list(config["packages"])


def _tree_packages() -> set[str]:
    found = set()
    for base, name in ((ROOT / "libs" / "torchrelay", "torchrelay"), (ROOT / "services", INSIDE)):
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            found.add(".".join((name, *rel)))
    return found


def test_every_package_of_the_tree_is_listed_for_the_wheel() -> None:
    # The list is explicit (the services are mapped into torchrelay): a new subpackage that
    # is not listed would be left out of the wheel without a word.
    assert set(_listed_packages()) == _tree_packages()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [*PIP_WHEEL, "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [built] = out.glob("torchrelay-*.whl")
    return built


def test_the_wheel_installs_only_torchrelay_at_the_top(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"torchrelay"}
    lua = [n for n in names if n.startswith("torchrelay/_control_plane/services/spare_pool/lua/")]
    assert len(lua) == len(list((ROOT / "services" / "spare_pool" / "lua").glob("*.lua")))
    assert "torchrelay/_control_plane/services/api/__main__.py" in names


def test_a_service_imports_from_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    probe = (
        "import json, os, torchrelay.runtime as r;"
        "print(json.dumps([r.__file__, str(r.services_path()),"
        " r.with_services_path(dict(os.environ))['PYTHONPATH']]))"
    )
    seen = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert seen.returncode == 0, seen.stderr
    where, root, path = json.loads(seen.stdout)
    assert where.startswith(str(site)), "the test must run the extracted wheel's torchrelay"
    assert root == str(site / "torchrelay" / "_control_plane")
    # Without the services path there is no top-level ``services`` to import ...
    plain = subprocess.run(
        [sys.executable, "-c", "import services"], cwd=tmp_path, env=env, capture_output=True
    )
    assert plain.returncode != 0
    # ... and with it a service's modules and their data files load from the wheel.
    code = "import services.spare_pool.inventory as i; print(i.__file__, len(i._lua('lib.lua')))"
    loaded = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=dict(env, PYTHONPATH=path),
        capture_output=True,
        text=True,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.startswith(root)
    assert int(loaded.stdout.split()[1]) > 0
