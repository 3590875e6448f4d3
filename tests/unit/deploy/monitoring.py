"""Static checks of the monitoring files against the code: Prometheus scrape configurations,
Grafana provisioning and dashboards.

Neither Prometheus nor Grafana runs on the development machines, so these checks stand in:
the metrics the services export are read from the code (every prometheus_client definition
under libs/ and services/, instantiated with prometheus_client to get the names it really
exposes), every dashboard query is taken apart into its selectors and labels and checked
against them, and the Kubernetes relabelling is run over the pods of the manifests. Like
:mod:`tests.unit.deploy.checks`, each check returns a list of problems (empty = fine), so
the tests can feed it broken copies and see it complain.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import prometheus_client
import yaml
from prometheus_client import CollectorRegistry
from starlette.exceptions import StarletteDeprecationWarning

from tests.unit.deploy import checks
from torchrelay.contract import SERVICES

REPO = checks.REPO
PROMETHEUS_COMPOSE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA_DIR = REPO / "deploy" / "grafana"
DASHBOARD_DIR = GRAFANA_DIR / "dashboards"
PROVISIONING_DIR = GRAFANA_DIR / "provisioning"
K8S_PROMETHEUS_CONFIGMAP = "prometheus-config"
GRAFANA_DEFAULT_PROVISIONING = "/etc/grafana/provisioning"
PROMETHEUS_DEFAULT_PORT = 9090

METRIC_TYPES = ("Counter", "Gauge", "Histogram", "Summary", "Info", "Enum")
# Labels Prometheus puts on every scraped series (the target's), besides the metric's own.
TARGET_LABELS = frozenset({"job", "instance"})
# Series Prometheus itself writes for each target (prometheus.io/docs, "Jobs and instances").
PROMETHEUS_SERIES: Mapping[str, frozenset[str]] = {
    "up": TARGET_LABELS,
    "scrape_duration_seconds": TARGET_LABELS,
    "scrape_samples_scraped": TARGET_LABELS,
}
# The PromQL language (prometheus.io/docs/prometheus/latest/querying/functions/, operators/).
PROMQL_AGGREGATIONS = frozenset(
    {
        "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
        "bottomk", "topk", "quantile", "limitk", "limit_ratio",
    }
)  # fmt: skip
PROMQL_FUNCTIONS = frozenset(
    {
        "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max",
        "clamp_min", "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta",
        "deriv", "exp", "floor", "histogram_avg", "histogram_count", "histogram_fraction",
        "histogram_quantile", "histogram_stddev", "histogram_stdvar", "histogram_sum",
        "holt_winters", "hour", "idelta", "increase", "irate", "label_join", "label_replace",
        "ln", "log2", "log10", "minute", "month", "predict_linear", "rate", "resets", "round",
        "scalar", "sgn", "sort", "sort_desc", "sort_by_label", "sort_by_label_desc", "sqrt",
        "time", "timestamp", "vector", "year", "avg_over_time", "min_over_time",
        "max_over_time", "sum_over_time", "count_over_time", "quantile_over_time",
        "stddev_over_time", "stdvar_over_time", "last_over_time", "present_over_time", "acos",
        "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "sin", "sinh", "tan", "tanh",
        "deg", "rad", "pi",
    }
)  # fmt: skip
PROMQL_LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
PROMQL_WORDS = frozenset({"and", "or", "unless", "bool", "atan2", "offset", "inf", "nan"})
# Grafana's own variables (grafana.com/docs/grafana/latest/dashboards/variables/).
GRAFANA_BUILTINS = frozenset(
    {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms"}
)
PANEL_TYPES = frozenset(
    {"row", "timeseries", "stat", "bargauge", "table", "heatmap", "gauge", "text", "barchart"}
)


# ------------------------------------------------------------- what the services export


@dataclass(frozen=True)
class MetricDefinition:
    """One prometheus_client metric constructed in the code, as written there."""

    kind: str
    kwargs: Mapping[str, Any]
    where: str
    services: frozenset[str]  # the service processes whose /metrics expose it


@dataclass(frozen=True)
class ExportedSeries:
    """A series name a scrape returns, its labels and who exports it."""

    labels: frozenset[str]
    services: frozenset[str]
    where: str


def _literal(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _prometheus_names(tree: ast.Module) -> tuple[dict[str, str], set[str]]:
    """Names bound to prometheus_client's metric classes, and aliases of the module."""
    classes: dict[str, str] = {}
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "prometheus_client":
            for alias in node.names:
                if alias.name in METRIC_TYPES:
                    classes[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "prometheus_client":
                    modules.add(alias.asname or alias.name)
    return classes, modules


def _owners(path: Path, enclosing_class: str | None) -> frozenset[str]:
    """The services whose processes construct a metric defined at ``path``.

    A service's own modules: that service. ``ServiceMetrics`` (libs/torchrelay/observability):
    every service (each process builds one, torchrelay.service and the api's ApiState). A
    metric anywhere else in libs/ is built by no service process (the agent, the CLI), so no
    scrape target serves it.
    """
    if not path.is_relative_to(REPO):
        return frozenset()
    rel = path.relative_to(REPO).parts
    if rel[0] == "services" and len(rel) > 2:
        return frozenset({rel[1]})
    if rel[-1] == "observability.py" and enclosing_class == "ServiceMetrics":
        return frozenset(SERVICES)
    return frozenset()


def _class_of_each_node(tree: ast.Module) -> dict[ast.AST, str]:
    out: dict[ast.AST, str] = {}
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        for node in ast.walk(cls):
            out[node] = cls.name
    return out


def metric_definitions(
    roots: Iterable[Path] | None = None,
) -> tuple[list[MetricDefinition], list[str]]:
    """Every prometheus_client metric constructed under ``roots`` (libs/torchrelay, services),
    and problems: a definition whose name or labels are not literals cannot be checked."""
    roots = list(roots) if roots is not None else [REPO / "libs" / "torchrelay", REPO / "services"]
    found: list[MetricDefinition] = []
    problems: list[str] = []
    for path in sorted(p for root in roots for p in root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        classes, modules = _prometheus_names(tree)
        if not classes and not modules:
            continue
        enclosing = _class_of_each_node(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id in classes:
                kind = classes[func.id]
            elif (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id in modules
                and func.attr in METRIC_TYPES
            ):
                kind = func.attr
            else:
                continue
            where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{node.lineno}"
            positional = ("name", "documentation", "labelnames")
            kwargs: dict[str, Any] = {}
            for key, arg in zip(positional, node.args, strict=False):
                kwargs[key] = _literal(arg)
            for kw in node.keywords:
                if kw.arg in (*positional, "namespace", "subsystem", "unit", "states"):
                    kwargs[kw.arg] = _literal(kw.value)
            if not isinstance(kwargs.get("name"), str):
                problems.append(f"{where}: the {kind}'s name is not a string literal")
                continue
            labels = kwargs.get("labelnames", ())
            if labels is None or not all(isinstance(x, str) for x in labels):
                problems.append(f"{where}: the labels of {kwargs['name']} are not literals")
                continue
            found.append(MetricDefinition(kind, kwargs, where, _owners(path, enclosing.get(node))))
    return found, problems


def series_of(definition: MetricDefinition) -> dict[str, frozenset[str]]:
    """The series names (and their labels) prometheus_client exposes for a definition: it is
    built in a scratch registry and collected, so ``_total``, ``_bucket``, ``_created`` and
    the rest are prometheus_client's, not a rule of ours."""
    registry = CollectorRegistry()
    cls = getattr(prometheus_client, definition.kind)
    kwargs = {k: v for k, v in definition.kwargs.items() if v is not None}
    kwargs.setdefault("documentation", "probe")
    kwargs["labelnames"] = tuple(kwargs.get("labelnames", ()))
    metric = cls(registry=registry, **kwargs)
    if kwargs["labelnames"]:
        metric.labels(*["probe"] * len(kwargs["labelnames"]))
    return {
        sample.name: frozenset(sample.labels)
        for family in registry.collect()
        for sample in family.samples
    }


@functools.cache
def exported_series() -> Mapping[str, ExportedSeries]:
    """Every series a torchrelay service's /metrics can return, from the code."""
    definitions, problems = metric_definitions()
    if problems:
        raise AssertionError(problems)
    out: dict[str, ExportedSeries] = {}
    for definition in definitions:
        if not definition.services:
            continue
        for name, labels in series_of(definition).items():
            seen = out.get(name)
            services = definition.services | (seen.services if seen else frozenset())
            out[name] = ExportedSeries(labels, services, definition.where)
    return out


# ------------------------------------------------------------------------ PromQL


@dataclass(frozen=True)
class Selector:
    """A vector selector of a PromQL expression: a metric and its label matchers."""

    metric: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, operator, value)


@dataclass(frozen=True)
class ParsedQuery:
    selectors: tuple[Selector, ...]
    grouping: frozenset[str]  # labels of by/without/on/ignoring/group_left/group_right
    variables: frozenset[str]  # Grafana variables it uses ($name, ${name})
    problems: tuple[str, ...]


_STRING = r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`'
_TOKEN = re.compile(
    rf"""(?P<string>{_STRING})
    |(?P<range>\[[^\]]*\])
    |(?P<braces>\{{(?:{_STRING}|[^}}"'`])*\}})
    |(?P<var>\$\{{\w+\}}|\$\w+)
    |(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[a-zA-Z]*)
    |(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    |(?P<paren>[()])
    |(?P<comma>,)
    |(?P<space>\s+)
    |(?P<op>[-+*/%^=!<>~@]+)""",
    re.VERBOSE,
)
_MATCHER = re.compile(rf"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*({_STRING})\s*(?:,|$)")
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def _unquote(text: str) -> str:
    return str(ast.literal_eval(text)) if text[0] in "\"'" else text[1:-1]


def parse_matchers(braces: str) -> tuple[list[tuple[str, str, str]], str | None]:
    """``{a="x", b=~"y"}`` -> [(a, =, x), (b, =~, y)], or a problem naming what is left."""
    body = braces[1:-1].strip()
    out = []
    pos = 0
    while pos < len(body):
        m = _MATCHER.match(body, pos)
        if not m:
            return out, f"unparsable label matchers {braces!r}"
        out.append((m.group(1), m.group(2), _unquote(m.group(3))))
        pos = m.end()
    return out, None


def parse_promql(expr: str) -> ParsedQuery:
    """The selectors, grouping labels and Grafana variables of a PromQL expression.

    Not a full parser: enough of the grammar to find every metric name and label an
    expression names, and to refuse (as a problem) what it does not understand.
    """
    problems: list[str] = []
    variables = {next(g for g in m.groups() if g) for m in _VARIABLE.finditer(expr)}
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            problems.append(f"cannot read {expr[pos : pos + 20]!r} in {expr!r}")
            break
        kind = m.lastgroup or ""
        if kind != "space":
            tokens.append((kind, m.group()))
        pos = m.end()
    selectors: list[Selector] = []
    grouping: set[str] = set()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ("", "")
        if kind == "ident" and text in PROMQL_LABEL_LISTS:
            if nxt == ("paren", "("):
                j = i + 2
                while j < len(tokens) and tokens[j] != ("paren", ")"):
                    if tokens[j][0] == "ident":
                        grouping.add(tokens[j][1])
                    elif tokens[j][0] != "comma":
                        problems.append(f"{text} (...) holds {tokens[j][1]!r} in {expr!r}")
                    j += 1
                i = j
        elif kind == "ident" and nxt == ("paren", "("):
            if text not in PROMQL_FUNCTIONS | PROMQL_AGGREGATIONS:
                problems.append(f"{text}() is no PromQL function or aggregation in {expr!r}")
        elif kind == "ident" and (
            (text in PROMQL_AGGREGATIONS and nxt[1] in ("by", "without"))
            or text.lower() in PROMQL_WORDS
        ):
            pass  # `sum by (...) (...)`: the label list comes next; and, or, offset, ...
        elif kind == "ident":
            matchers: list[tuple[str, str, str]] = []
            if nxt[0] == "braces":
                matchers, problem = parse_matchers(nxt[1])
                if problem:
                    problems.append(f"{problem} in {expr!r}")
                i += 1
            selectors.append(Selector(text, tuple(matchers)))
        elif kind == "braces":
            problems.append(f"a selector without a metric name {text!r} in {expr!r}")
        elif kind == "var":
            problems.append(f"a Grafana variable {text} outside a string in {expr!r}")
        i += 1
    return ParsedQuery(tuple(selectors), frozenset(grouping), frozenset(variables), tuple(problems))


def _job_values(operator: str, value: str) -> list[str] | None:
    """The job names a matcher on ``job`` names, when they can be read off it."""
    if operator in ("=", "!="):
        return [value]
    if re.fullmatch(r"[\w-]+(\|[\w-]+)*", value):
        return value.split("|")
    return None


def query_problems(
    where: str,
    expr: str,
    series: Mapping[str, ExportedSeries],
    jobs: frozenset[str],
    legend: str = "",
) -> list[str]:
    """A query names only exported series, their labels, and the scrape jobs' names."""
    parsed = parse_promql(expr)
    problems = [f"{where}: {p}" for p in parsed.problems]
    if not parsed.selectors:
        problems.append(f"{where}: {expr!r} queries no metric")
    known_labels = set(TARGET_LABELS)
    for sel in parsed.selectors:
        if sel.metric in PROMETHEUS_SERIES:
            labels = PROMETHEUS_SERIES[sel.metric]
        elif sel.metric in series:
            labels = series[sel.metric].labels | TARGET_LABELS
        else:
            problems.append(
                f"{where}: {sel.metric} is exported by no torchrelay service (no "
                "prometheus_client definition in libs/ or services/ exposes that series)"
            )
            continue
        known_labels |= labels
        for label, operator, value in sel.matchers:
            if label not in labels and label != "__name__":
                problems.append(f"{where}: {sel.metric} has no label {label!r}")
            if label == "job":
                for job in _job_values(operator, value) or []:
                    if job not in jobs:
                        problems.append(
                            f"{where}: job {job!r} is no job of the Prometheus configurations "
                            f"({sorted(jobs)})"
                        )
    for label in sorted(parsed.grouping - known_labels):
        problems.append(f"{where}: groups by {label!r}, a label of none of its metrics")
    for label in sorted(set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend)) - known_labels):
        problems.append(f"{where}: the legend shows {label!r}, a label of none of its metrics")
    return problems


# ------------------------------------------------------------------------ Grafana


def load_dashboards(directory: Path = DASHBOARD_DIR) -> dict[str, dict[str, Any]]:
    """File name -> the parsed dashboard JSON."""
    return {p.name: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


def _panels(board: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    out = []
    for panel in board.get("panels") or []:
        out.append(panel)
        out += panel.get("panels") or []  # a collapsed row holds its panels
    return out


_LABEL_VALUES = re.compile(r"label_values\(\s*(?:(.+?)\s*,\s*)?(\w+)\s*\)")


def _datasource_problem(where: str, ds: Any, ds_uids: frozenset[str]) -> str | None:
    if (
        not isinstance(ds, Mapping)
        or ds.get("type") != "prometheus"
        or ds.get("uid") not in ds_uids
    ):
        return f"{where}: datasource {ds!r} is not the Prometheus one ({sorted(ds_uids)})"
    return None


def dashboard_problems(
    name: str,
    board: Mapping[str, Any],
    series: Mapping[str, ExportedSeries],
    jobs: frozenset[str],
    provisioned_uids: frozenset[str],
) -> list[str]:
    """The dashboard's structure, its variables, and every query of every panel."""
    problems: list[str] = []
    for key, kind in (("uid", str), ("title", str), ("schemaVersion", int), ("panels", list)):
        if not isinstance(board.get(key), kind):
            problems.append(f"{name}: {key} missing or not a {kind.__name__}")
    if problems:
        return problems
    if not 0 < len(board["uid"]) <= 40:
        problems.append(f"{name}: uid {board['uid']!r} must be 1 to 40 characters")
    variables = (board.get("templating") or {}).get("list") or []
    var_names = [v.get("name") for v in variables]
    if len(set(var_names)) != len(var_names):
        problems.append(f"{name}: variables {var_names} are not unique")
    ds_vars = {
        v["name"]
        for v in variables
        if v.get("type") == "datasource" and v.get("query") == "prometheus"
    }
    ds_uids = (
        frozenset({f"${{{v}}}" for v in ds_vars} | {f"${v}" for v in ds_vars}) | provisioned_uids
    )
    defined = set(var_names) | GRAFANA_BUILTINS
    for var in variables:
        where = f"{name} variable {var.get('name')}"
        if var.get("type") != "query":
            continue
        if problem := _datasource_problem(where, var.get("datasource"), ds_uids):
            problems.append(problem)
        query = var.get("query")
        text = query.get("query") if isinstance(query, Mapping) else query
        m = _LABEL_VALUES.fullmatch(str(text or "").strip())
        if not m:
            problems.append(f"{where}: the check reads label_values(metric, label) only: {text!r}")
            continue
        selector, label = m.group(1), m.group(2)
        if selector is None:
            problems.append(f"{where}: label_values without a metric searches every series")
            continue
        problems += query_problems(where, selector, series, jobs, f"{{{{{label}}}}}")
    ids: list[Any] = []
    for panel in _panels(board):
        where = f"{name} panel {panel.get('id')} {panel.get('title')!r}"
        ids.append(panel.get("id"))
        if panel.get("type") not in PANEL_TYPES:
            problems.append(
                f"{where}: type {panel.get('type')!r} is not one of {sorted(PANEL_TYPES)}"
            )
        pos = panel.get("gridPos") or {}
        if not all(isinstance(pos.get(k), int) for k in "xywh"):
            problems.append(f"{where}: gridPos {pos!r} needs integer x, y, w and h")
        elif pos["x"] < 0 or pos["w"] < 1 or pos["h"] < 1 or pos["x"] + pos["w"] > 24:
            problems.append(f"{where}: gridPos {pos!r} does not fit Grafana's 24 columns")
        if not panel.get("title"):
            problems.append(f"{where}: no title")
        if panel.get("type") in ("row", "text"):
            continue
        targets = panel.get("targets") or []
        if not targets:
            problems.append(f"{where}: no queries")
        if problem := _datasource_problem(where, panel.get("datasource"), ds_uids):
            problems.append(problem)
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or None in refs:
            problems.append(f"{where}: refIds {refs} are not unique")
        for target in targets:
            twhere = f"{where} query {target.get('refId')}"
            if target.get("datasource") is not None and (
                problem := _datasource_problem(twhere, target["datasource"], ds_uids)
            ):
                problems.append(problem)
            expr = target.get("expr")
            if not isinstance(expr, str) or not expr.strip():
                problems.append(f"{twhere}: no expr")
                continue
            legend = str(target.get("legendFormat") or "")
            problems += query_problems(twhere, expr, series, jobs, legend)
            for var in sorted(parse_promql(expr).variables - defined):
                problems.append(f"{twhere}: ${var} is no variable of the dashboard")
    if len(set(ids)) != len(ids):
        problems.append(f"{name}: panel ids {ids} are not unique")
    return problems


def dashboards_problems(
    boards: Mapping[str, Mapping[str, Any]],
    series: Mapping[str, ExportedSeries],
    jobs: frozenset[str],
    provisioned_uids: frozenset[str],
) -> list[str]:
    """Every dashboard's problems, and uids and titles unique across them."""
    problems: list[str] = []
    if not boards:
        problems.append(f"{DASHBOARD_DIR.relative_to(REPO)}: no dashboards")
    for name, board in boards.items():
        problems += dashboard_problems(name, board, series, jobs, provisioned_uids)
    for key in ("uid", "title"):
        values = [b.get(key) for b in boards.values()]
        if len(set(values)) != len(values):
            problems.append(f"dashboards: {key}s {values} are not unique")
    return problems


def _compose_mounts(svc: Mapping[str, Any]) -> dict[str, str]:
    """Container path -> host path of a compose service's bind mounts and volumes."""
    out = {}
    for mount in svc.get("volumes") or []:
        parts = str(mount).split(":")
        if len(parts) >= 2:
            out[parts[1]] = parts[0]
    return out


def _flag(argv: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
    return None


def compose_prometheus(compose: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    """(name, service) of the compose service that runs Prometheus."""
    for name, svc in (compose.get("services") or {}).items():
        if str(svc.get("image", "")).startswith("prom/prometheus"):
            return name, svc
    return None


def prometheus_port(svc: Mapping[str, Any]) -> int:
    """The port Prometheus listens on (``--web.listen-address``, default 9090)."""
    address = _flag(checks.as_argv(svc.get("command")), "--web.listen-address")
    return int(address.rsplit(":", 1)[1]) if address else PROMETHEUS_DEFAULT_PORT


def compose_monitoring_problems(compose: Mapping[str, Any]) -> list[str]:
    """Prometheus runs deploy/prometheus/prometheus.yml with its data on a volume; Grafana
    gets the provisioning directory and the dashboards where the provider looks."""
    problems: list[str] = []
    found = compose_prometheus(compose)
    if found is None:
        return ["docker-compose.yml: no service runs prom/prometheus"]
    name, prom = found
    argv = checks.as_argv(prom.get("command"))
    mounts = _compose_mounts(prom)
    config = _flag(argv, "--config.file")
    expected = "./" + str(PROMETHEUS_COMPOSE_CONFIG.relative_to(REPO))
    if config is None or mounts.get(config) != expected:
        problems.append(
            f"docker-compose.yml service {name}: --config.file={config} is not {expected} "
            "mounted from the repository"
        )
    store = _flag(argv, "--storage.tsdb.path") or "/prometheus"
    if mounts.get(store, "./").startswith("."):
        problems.append(f"docker-compose.yml service {name}: its TSDB {store} is not on a volume")
    grafana = next(
        (
            (n, s)
            for n, s in (compose.get("services") or {}).items()
            if str(s.get("image", "")).startswith("grafana/grafana")
        ),
        None,
    )
    if grafana is None:
        return [*problems, "docker-compose.yml: no service runs grafana/grafana"]
    gname, gsvc = grafana
    gmounts = _compose_mounts(gsvc)
    env = checks.compose_env(gsvc)
    provisioning = env.get("GF_PATHS_PROVISIONING", GRAFANA_DEFAULT_PROVISIONING)
    want = "./" + str(PROVISIONING_DIR.relative_to(REPO))
    if gmounts.get(provisioning) != want:
        problems.append(
            f"docker-compose.yml service {gname}: {want} is not mounted at its provisioning "
            f"path {provisioning}"
        )
    dashboards = "./" + str(DASHBOARD_DIR.relative_to(REPO))
    for provider in dashboard_providers():
        path = (provider.get("options") or {}).get("path")
        if gmounts.get(str(path)) != dashboards:
            problems.append(
                f"docker-compose.yml service {gname}: the provider {provider.get('name')!r} "
                f"reads {path}, where {dashboards} is not mounted"
            )
    return problems


def dashboard_providers(directory: Path = PROVISIONING_DIR) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted((directory / "dashboards").glob("*.y*ml")):
        out += (checks.load_yaml(path) or {}).get("providers") or []
    return out


def datasources(directory: Path = PROVISIONING_DIR) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted((directory / "datasources").glob("*.y*ml")):
        out += (checks.load_yaml(path) or {}).get("datasources") or []
    return out


def provisioning_problems(
    compose: Mapping[str, Any], directory: Path = PROVISIONING_DIR
) -> list[str]:
    """Provisioning files as Grafana reads them: apiVersion 1, a Prometheus datasource at
    the compose Prometheus, a file provider."""
    problems: list[str] = []
    for sub in ("datasources", "dashboards"):
        files = sorted((directory / sub).glob("*.y*ml"))
        if not files:
            problems.append(f"provisioning/{sub}: no YAML file")
        for path in files:
            doc = checks.load_yaml(path) or {}
            if doc.get("apiVersion") != 1:
                problems.append(f"provisioning/{sub}/{path.name}: apiVersion is not 1")
    proms = [d for d in datasources(directory) if d.get("type") == "prometheus"]
    if len(proms) != 1:
        problems.append(f"provisioning/datasources: {len(proms)} Prometheus datasources, not 1")
    found = compose_prometheus(compose)
    for ds in proms:
        host, port = checks.url_host_port(str(ds.get("url", "")))
        if found is None or host != found[0] or (port or 80) != prometheus_port(found[1]):
            problems.append(
                f"provisioning/datasources: {ds.get('name')} points at {host}:{port}, not the "
                "compose Prometheus and its port"
            )
        if ds.get("access", "proxy") != "proxy":
            problems.append(
                "provisioning/datasources: access must be proxy (the browser "
                "cannot resolve compose service names)"
            )
    for provider in dashboard_providers(directory):
        if provider.get("type", "file") != "file" or not (provider.get("options") or {}).get(
            "path"
        ):
            problems.append(f"provisioning/dashboards: {provider.get('name')} is no file provider")
    return problems


def provisioned_uids(directory: Path = PROVISIONING_DIR) -> frozenset[str]:
    return frozenset(str(d["uid"]) for d in datasources(directory) if d.get("uid"))


# ---------------------------------------------------------------- scrape targets


@dataclass(frozen=True)
class ScrapeTarget:
    """Where Prometheus scrapes one process, and which torchrelay service that is."""

    job: str
    module: str  # services.<name>
    port: int
    path: str
    where: str


def _service_module(argv: Sequence[str]) -> str | None:
    if len(argv) == 3 and argv[:2] == ["python", "-m"] and argv[2].startswith("services."):
        return argv[2]
    return None


def api_get(path: str) -> tuple[int, str, str]:
    """(status, content type, body) of a GET on the api app (not started: no connections)."""
    with warnings.catch_warnings():
        # As tests/unit/api/conftest.py: Starlette asks for httpx2; httpx works.
        warnings.simplefilter("ignore", StarletteDeprecationWarning)
        from fastapi.testclient import TestClient

    from services.api.app import create_app

    response = TestClient(create_app()).get(path)
    return response.status_code, response.headers.get("content-type", ""), response.text


@functools.cache
def _served(module: str, path: str) -> bool:
    """Whether the service's HTTP server answers ``path`` with Prometheus' text format."""
    if module == "services.api":
        code, ctype, _ = api_get(path)
        return code == 200 and ctype == prometheus_client.CONTENT_TYPE_LATEST
    from torchrelay.observability import ServiceMetrics
    from torchrelay.service import HealthServer

    server = HealthServer(None, ServiceMetrics("probe"), lambda: (True, {}))
    status, ctype, _ = server._route(path)
    if not status.startswith("200"):
        return False
    return ctype == prometheus_client.CONTENT_TYPE_LATEST


def served_metrics_problem(where: str, module: str, path: str) -> str | None:
    if not _served(module, path):
        return f"{where}: {module} serves no Prometheus metrics at {path}"
    return None


def compose_scrape_targets(
    compose: Mapping[str, Any], config: Mapping[str, Any]
) -> tuple[list[ScrapeTarget], list[str]]:
    """The compose Prometheus' targets, each a torchrelay service on its metrics port."""
    problems: list[str] = []
    targets: list[ScrapeTarget] = []
    services = compose.get("services") or {}
    for sc in config.get("scrape_configs") or []:
        job = str(sc.get("job_name"))
        where = f"prometheus.yml job {job}"
        if set(sc) - {"job_name", "metrics_path", "static_configs", "scrape_interval", "scheme"}:
            problems.append(f"{where}: the check reads static_configs only: {sorted(sc)}")
        path = str(sc.get("metrics_path", "/metrics"))
        for static in sc.get("static_configs") or []:
            for address in static.get("targets") or []:
                host, _, port = str(address).rpartition(":")
                twhere = f"{where} target {address}"
                svc = services.get(host)
                if svc is None:
                    problems.append(f"{twhere}: {host} is no service of docker-compose.yml")
                    continue
                module = _service_module(checks.as_argv(svc.get("command")))
                if module is None:
                    problems.append(f"{twhere}: {host} runs no torchrelay service")
                    continue
                http_port = checks._interpolated_default(
                    checks.compose_env(svc).get("TORCHRELAY_HTTP_PORT", "")
                )
                if port != http_port:
                    problems.append(
                        f"{twhere}: port {port}, but {host} serves its metrics on "
                        f"TORCHRELAY_HTTP_PORT={http_port}"
                    )
                if problem := served_metrics_problem(twhere, module, path):
                    problems.append(problem)
                targets.append(ScrapeTarget(job, module, int(port or 0), path, twhere))
    return targets, problems


# Prometheus' relabelling (prometheus.io/docs/prometheus/latest/configuration/configuration/
# #relabel_config), the actions this base uses.
def _expand(match: re.Match[str], replacement: str) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        try:
            return match.group(int(name) if name.isdigit() else name) or ""
        except IndexError:
            return ""  # Go's Expand: an unknown group is empty

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, replacement)


def relabel(
    labels: Mapping[str, str], rules: Sequence[Mapping[str, Any]]
) -> tuple[dict[str, str] | None, list[str]]:
    """Run relabel_configs over one target's labels: the result, or None when dropped."""
    out = dict(labels)
    problems: list[str] = []
    for rule in rules:
        action = rule.get("action", "replace")
        regex = re.compile(f"(?:{rule.get('regex', '(.*)')})")
        value = str(rule.get("separator", ";")).join(
            out.get(str(s), "") for s in rule.get("source_labels") or []
        )
        if action == "keep":
            if not regex.fullmatch(value):
                return None, problems
        elif action == "drop":
            if regex.fullmatch(value):
                return None, problems
        elif action == "replace":
            m = regex.fullmatch(value)
            if m is not None:
                target = _expand(m, str(rule.get("target_label", "")))
                result = _expand(m, str(rule.get("replacement", "$1")))
                if result:
                    out[target] = result
                else:
                    out.pop(target, None)
        elif action == "labelmap":
            for name, v in list(out.items()):
                m = regex.fullmatch(name)
                if m is not None:
                    out[_expand(m, str(rule.get("replacement", "$1")))] = v
        else:
            problems.append(f"relabel action {action!r} is not simulated by the check")
    return out, problems


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pod_discovery(
    docs: Sequence[Mapping[str, Any]], namespace: str
) -> list[tuple[str, Mapping[str, Any], dict[str, str]]]:
    """(where, container, labels) of every target Kubernetes pod discovery would offer for the
    manifests' pod templates: one per container port, one per container without a port."""
    out = []
    for wl in checks._workloads(docs):
        meta = wl["spec"]["template"].get("metadata") or {}
        base = {
            "__meta_kubernetes_namespace": namespace,
            "__meta_kubernetes_pod_name": f"{wl['metadata']['name']}-0",
            "__meta_kubernetes_pod_ip": "10.0.0.1",
            "__meta_kubernetes_pod_phase": "Running",
            "__meta_kubernetes_pod_ready": "true",
        }
        for kind, values in (
            ("label", meta.get("labels")),
            ("annotation", meta.get("annotations")),
        ):
            for key, value in (values or {}).items():
                base[f"__meta_kubernetes_pod_{kind}_{_sanitize(key)}"] = str(value)
                base[f"__meta_kubernetes_pod_{kind}present_{_sanitize(key)}"] = "true"
        for c in checks._pod_spec(wl).get("containers") or []:
            where = f"{wl['kind']}/{wl['metadata']['name']} container {c['name']}"
            common = {
                **base,
                "__meta_kubernetes_pod_container_name": c["name"],
                "__meta_kubernetes_pod_container_init": "false",
            }
            ports = c.get("ports") or []
            if not ports:
                out.append((where, c, {**common, "__address__": "10.0.0.1"}))
            for p in ports:
                out.append(
                    (
                        f"{where} port {p.get('name') or p['containerPort']}",
                        c,
                        {
                            **common,
                            "__address__": f"10.0.0.1:{p['containerPort']}",
                            "__meta_kubernetes_pod_container_port_name": str(p.get("name", "")),
                            "__meta_kubernetes_pod_container_port_number": str(p["containerPort"]),
                            "__meta_kubernetes_pod_container_port_protocol": str(
                                p.get("protocol", "TCP")
                            ),
                        },
                    )
                )
    return out


def k8s_scrape_targets(
    docs: Sequence[Mapping[str, Any]], namespace: str, config: Mapping[str, Any]
) -> tuple[list[ScrapeTarget], list[str]]:
    """The targets the Kubernetes configuration finds among the manifests' pods, each a
    torchrelay service on the port and path it serves its metrics on."""
    problems: list[str] = []
    targets: list[ScrapeTarget] = []
    offered = pod_discovery(docs, namespace)
    for sc in config.get("scrape_configs") or []:
        job_name = str(sc.get("job_name"))
        where = f"prometheus-config job {job_name}"
        if sc.get("static_configs"):
            problems.append(f"{where}: static_configs are not checked against the manifests")
        for sd in sc.get("kubernetes_sd_configs") or []:
            if sd.get("role") != "pod":
                problems.append(f"{where}: role {sd.get('role')!r}; the check simulates pod")
                continue
            names = (sd.get("namespaces") or {}).get("names")
            if names is not None and namespace not in names:
                problems.append(
                    f"{where}: discovers pods in {names}, but the base deploys to {namespace}"
                )
                continue
            for pwhere, container, labels in offered:
                kept, rp = relabel(labels, sc.get("relabel_configs") or [])
                problems += [f"{where}: {p}" for p in rp]
                if kept is None:
                    continue
                twhere = f"{where} target {pwhere}"
                job = kept.get("job", job_name)
                path = kept.get("__metrics_path__", str(sc.get("metrics_path", "/metrics")))
                host, _, port = kept.get("__address__", "").rpartition(":")
                module = _service_module(checks.as_argv(container.get("command")))
                if module is None:
                    problems.append(
                        f"{twhere}: scrapes a container that runs no torchrelay service"
                    )
                    continue
                env = checks.container_env(docs, container)
                http_port = env.get("TORCHRELAY_HTTP_PORT")
                declared = [str(p["containerPort"]) for p in container.get("ports") or []]
                if not host or port != http_port or port not in declared:
                    problems.append(
                        f"{twhere}: scrapes port {port or '(none)'}, but the container serves "
                        f"metrics on TORCHRELAY_HTTP_PORT={http_port} (declared {declared})"
                    )
                if problem := served_metrics_problem(twhere, module, path):
                    problems.append(problem)
                targets.append(ScrapeTarget(job, module, int(port or 0), path, twhere))
    return targets, problems


def coverage_problems(where: str, targets: Sequence[ScrapeTarget]) -> list[str]:
    """Every service of contract.SERVICES is scraped by exactly one job, one job per service."""
    problems = []
    for service in SERVICES:
        jobs = {t.job for t in targets if t.module == f"services.{service}"}
        if len(jobs) != 1:
            problems.append(
                f"{where}: services.{service} is scraped by jobs {sorted(jobs)}, not one"
            )
    by_job: dict[str, set[str]] = {}
    for t in targets:
        by_job.setdefault(t.job, set()).add(t.module)
    problems += [
        f"{where}: job {job} scrapes {sorted(mods)}"
        for job, mods in by_job.items()
        if len(mods) > 1
    ]
    return problems


def jobs_by_module(targets: Iterable[ScrapeTarget]) -> dict[str, str]:
    return {t.module: t.job for t in targets}


def k8s_prometheus_config(docs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    data = checks.configmap_data(docs, K8S_PROMETHEUS_CONFIGMAP)
    config: dict[str, Any] = yaml.safe_load(data["prometheus.yml"])
    return config
