"""Static checks of the deployment files against the code: parsed files in, problems out.

Docker and Kubernetes do not run on the development machines, so these checks are what
keeps docker-compose.yml, the Dockerfile and deploy/kubernetes/ true to the code: every
command is a real entry point, every environment variable is a setting the settings classes
read, ports and probes agree with ``TORCHRELAY_HTTP_PORT``, and NATS and Redis run with the
durability of ``torchrelay up``. Each check returns a list of problems (empty = fine) so the
tests can also feed it broken input and show that it complains.
"""

from __future__ import annotations

import ast
import contextlib
import fnmatch
import functools
import importlib
import importlib.metadata
import io
import re
import shlex
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import yaml
from pydantic import AliasChoices
from pydantic_settings import BaseSettings

from torchrelay import runtime, stack
from torchrelay.cli import COMMANDS
from torchrelay.contract import SERVICES
from torchrelay.settings import CommonSettings, ServiceSettings

REPO = Path(__file__).resolve().parents[3]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
K8S_DIR = REPO / "deploy" / "kubernetes"
NATS_CONF = REPO / "deploy" / "nats" / "nats.conf"
OTEL_CONF = REPO / "deploy" / "otel-collector.yaml"
COMPOSE_ENV_EXAMPLE = REPO / "deploy" / "compose.env.example"

IMAGE_REPOSITORY = "torchrelay/torchrelay"
PLACEHOLDER = "REPLACE_ME"

# Environment variables a torchrelay container may carry that no settings class reads.
ENV_ALLOWLIST: dict[str, str] = {
    "NODE_NAME": "the detector agent's --node value, from the downward API ($(NODE_NAME))",
    "REDIS_PASSWORD": "only expanded into REDIS_URL ($(REDIS_PASSWORD)), which torchrelay reads",
    "NVIDIA_VISIBLE_DEVICES": "read by the NVIDIA Container Toolkit to mount the GPUs for NVML",
    "NVIDIA_DRIVER_CAPABILITIES": "read by the NVIDIA Container Toolkit (utility = NVML)",
    "PYTHONUNBUFFERED": "the Python interpreter: logs reach the container runtime at once",
    "PYTHONDONTWRITEBYTECODE": "the Python interpreter: no .pyc in a read-only filesystem",
    "PATH": "the image's virtual environment",
    "PYTHONPATH": "the Python interpreter: where `python -m services.<name>` finds the services",
    "PIP_NO_CACHE_DIR": "pip, in the Dockerfile's build stage",
    "PIP_DISABLE_PIP_VERSION_CHECK": "pip, in the Dockerfile's build stage",
}

# What every service process gets from `torchrelay up` (libs/torchrelay/stack.py), and so
# must get from compose and Kubernetes too.
REQUIRED_SERVICE_ENV = (
    "NATS_URL",
    "REDIS_URL",
    "TORCHRELAY_HTTP_PORT",
    "TORCHRELAY_HTTP_HOST",
    "TORCHRELAY_HOME",
    "TORCHRELAY_ENVIRONMENT",
)
SECRET_NAME_PATTERN = re.compile(r"PASSWORD|TOKEN|SECRET|PEPPER|PRIVATE", re.IGNORECASE)
ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


# ------------------------------------------------------------------------ loading


def load_yaml(path: Path) -> Any:
    """One YAML document (PyYAML's safe loader: merge keys resolved)."""
    return yaml.safe_load(path.read_text())


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    """Every non-empty document of a multi-document YAML file."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def package_version() -> str:
    """The torchrelay package version: the image tag everywhere."""
    return importlib.metadata.version("torchrelay")


def expected_image() -> str:
    return f"{IMAGE_REPOSITORY}:{package_version()}"


def as_argv(command: str | Sequence[str] | None) -> list[str]:
    """A compose/Kubernetes command as an argv list (a string is split like a shell would)."""
    if command is None:
        return []
    if isinstance(command, str):
        return shlex.split(command)
    return [str(c) for c in command]


# ---------------------------------------------------------- what the code says


def _settings_class_defs(path: Path) -> list[ast.ClassDef]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                base_name = (
                    base.id
                    if isinstance(base, ast.Name)
                    else (base.attr if isinstance(base, ast.Attribute) else "")
                )
                if base_name.endswith("Settings"):
                    found.append(node)
                    break
    return found


def _field_env_names(cls: type[BaseSettings], field_name: str) -> set[str]:
    """The variables pydantic-settings reads for one field: its validation aliases if it has
    any, else env_prefix + the field name."""
    info = cls.model_fields[field_name]
    alias = info.validation_alias
    if isinstance(alias, AliasChoices):
        return {c.upper() for c in alias.choices if isinstance(c, str)}
    if isinstance(alias, str):
        return {alias.upper()}
    if info.alias:
        return {info.alias.upper()}
    return {f"{cls.model_config.get('env_prefix', '')}{field_name}".upper()}


def _env_names_of(cls: type[BaseSettings]) -> set[str]:
    return set().union(*(_field_env_names(cls, name) for name in cls.model_fields))


@functools.cache
def settings_classes() -> tuple[type[BaseSettings], ...]:
    """torchrelay.settings' classes plus each service's own settings classes.

    Service classes (e.g. ``services.api.settings.ApiSettings``) are found by scanning
    services/ for classes derived from a ``*Settings`` base and importing their module. A
    ``__main__.py`` is never imported (it may run the service); see :func:`known_env_names`.
    """
    import torchrelay.settings as base_settings

    classes: list[type[BaseSettings]] = [
        obj
        for obj in vars(base_settings).values()
        if isinstance(obj, type) and issubclass(obj, BaseSettings) and obj is not BaseSettings
    ]
    for path in sorted((REPO / "services").rglob("*.py")):
        defs = _settings_class_defs(path)
        if not defs or path.name == "__main__.py":
            continue
        module_name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        module = importlib.import_module(module_name)
        for cls_def in defs:
            obj = getattr(module, cls_def.name, None)
            if isinstance(obj, type) and issubclass(obj, BaseSettings):
                classes.append(obj)
    return tuple(classes)


def known_env_names() -> frozenset[str]:
    """Every environment variable a torchrelay settings class reads.

    The names come from the classes themselves (env_prefix + field name, or the field's
    validation aliases such as ``NATS_URL``). Settings classes defined in a service's
    ``__main__.py`` are read from the source, with the ``TORCHRELAY_`` prefix.
    """
    names: set[str] = set()
    for cls in settings_classes():
        names |= _env_names_of(cls)
    for path in sorted((REPO / "services").rglob("__main__.py")):
        for cls_def in _settings_class_defs(path):
            for stmt in cls_def.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    names.add(f"TORCHRELAY_{stmt.target.id}".upper())
    return frozenset(names)


def secret_env_names() -> frozenset[str]:
    """Settings typed ``SecretStr``: they belong in a Secret, never in a ConfigMap."""
    return frozenset(
        env
        for cls in settings_classes()
        for name, info in cls.model_fields.items()
        if "SecretStr" in repr(info.annotation)
        for env in _field_env_names(cls, name)
    )


def up_service_argv(name: str) -> list[str]:
    """The argv ``torchrelay up`` starts service ``name`` with (captured, not started)."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        mock.patch("torchrelay.stack.subprocess.Popen") as popen,
    ):
        stack.ManagedService(name, 0, {}, Path(tmp) / "svc.log").start()
    return [str(a) for a in popen.call_args.args[0]]


def embedded_redis_durability() -> dict[str, str]:
    """The durability flags the embedded redis-server runs with (libs/torchrelay/runtime.py)."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        mock.patch.object(runtime, "find_redis_server", return_value=Path("redis-server")),
    ):
        argv = runtime.redis_server(Path(tmp), port=6379).argv
    return {
        k: v
        for k, v in _flag_pairs(argv).items()
        if k in ("--appendonly", "--appendfsync", "--save")
    }


def embedded_nats_settings() -> dict[str, str]:
    """sync_interval and max_payload of the embedded nats-server's configuration."""
    text = runtime.nats_config_text(4222, Path("/data/jetstream"))
    return nats_conf_summary(text)


def _flag_pairs(argv: Sequence[str]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--") and i + 1 < len(argv):
            pairs[arg] = argv[i + 1]
    return pairs


# ------------------------------------------------------------------- entry points


def entry_point_problem(argv: Sequence[str]) -> str | None:
    """Why ``argv`` is not a torchrelay entry point, or None.

    Accepted: ``python -m services.<name>`` (a service of contract.SERVICES with a
    ``__main__.py``), ``python -m services.detector agent --node N --backend B``, and the
    ``torchrelay`` console script with a subcommand of torchrelay.cli.COMMANDS.
    """
    if not argv:
        return "no command: a torchrelay container must say which process it runs"
    if argv[0] == "torchrelay":
        if len(argv) < 2 or argv[1] not in COMMANDS:
            return (
                f"{shlex.join(argv)!r}: not a torchrelay subcommand "
                f"(torchrelay.cli.COMMANDS: {', '.join(COMMANDS)})"
            )
        return None
    if argv[0] not in ("python", "python3") or len(argv) < 3 or argv[1] != "-m":
        return (
            f"{shlex.join(argv)!r} is neither `python -m services.<name>` nor the "
            "`torchrelay` console script"
        )
    module, rest = argv[2], list(argv[3:])
    name = module.removeprefix("services.")
    if not module.startswith("services.") or name not in SERVICES:
        return f"{module} is not a service module (contract.SERVICES: {', '.join(SERVICES)})"
    if not (REPO / "services" / name / "__main__.py").is_file():
        return f"services/{name}/__main__.py does not exist: `python -m {module}` cannot run"
    if not rest:
        return None
    if name == "detector" and rest[0] == "agent":
        return _agent_args_problem(rest[1:])
    return (
        f"unexpected arguments {rest} after `python -m {module}`: torchrelay up runs it "
        "without arguments"
    )


def _agent_args_problem(args: Sequence[str]) -> str | None:
    """Parse the agent's arguments with the agent's own parser; check the backend names."""
    flags = _flag_pairs(args)
    for flag in ("--node", "--backend"):
        if not flags.get(flag) or flags[flag].startswith("--"):
            return f"the detector agent needs `{flag} VALUE` (got {list(args)})"
    try:
        from services.detector.agent import build_parser
        from torchrelay.telemetry import BACKENDS
    except ImportError as exc:
        return f"the agent mode `python -m services.detector agent` cannot be imported: {exc}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parsed = build_parser().parse_args(list(args))
    except SystemExit:
        return f"the detector agent rejects {list(args)}: {err.getvalue().strip()}"
    unknown = [b for b in str(parsed.backend).split(",") if b not in {"auto", *BACKENDS}]
    if unknown:
        return f"the detector agent has no backend {unknown} (known: auto, {', '.join(BACKENDS)})"
    return None


# ------------------------------------------------------------------- environment


def unknown_env_problems(where: str, names: Iterable[str], known: frozenset[str]) -> list[str]:
    """One problem per variable name that neither a settings class nor the allowlist knows."""
    return [
        f"{where}: environment variable {n} is read by no torchrelay settings class "
        "(typo, or a setting that does not exist); see ENV_ALLOWLIST for the exceptions"
        for n in sorted(set(names))
        if n not in known and n not in ENV_ALLOWLIST
    ]


def compose_env(service: Mapping[str, Any]) -> dict[str, str]:
    """A compose service's environment as a dict (list form ``K=V`` accepted)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _interpolated_default(value: str) -> str:
    """``${VAR:-default}`` → default; other text unchanged (enough for ports and hosts)."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}", r"\1", value)


def url_host_port(url: str) -> tuple[str | None, int | None]:
    parts = urlsplit(re.sub(r"\$\{[^}]*\}|\$\([^)]*\)", "x", url))
    return parts.hostname, parts.port


# --------------------------------------------------------------- NATS and Redis


def _strip_conf_comments(text: str) -> str:
    return "\n".join(re.sub(r"(^|\s)(#|//).*$", "", line) for line in text.splitlines())


def _block(text: str, name: str) -> str | None:
    match = re.search(rf"(?m)^\s*{name}\s*[:=]?\s*\{{", text)
    if match is None:
        return None
    depth, start = 0, match.end() - 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return None


def nats_conf_summary(text: str) -> dict[str, str]:
    """The settings of a nats-server configuration that the checks compare."""
    clean = _strip_conf_comments(text)
    out: dict[str, str] = {}
    js = _block(clean, "jetstream")
    if js is not None:
        out["jetstream"] = "enabled"
        m = re.search(r"sync_interval\s*[:=]\s*\"?([\w.]+)\"?", js)
        if m:
            out["sync_interval"] = m.group(1)
        m = re.search(r"store_dir\s*[:=]\s*\"?([^\"\s]+)\"?", js)
        if m:
            out["store_dir"] = m.group(1)
    m = re.search(r"(?m)^\s*max_payload\s*[:=]\s*\"?(\w+)\"?", clean)
    if m:
        out["max_payload"] = m.group(1)
    m = re.search(r"(?m)^\s*server_name\s*[:=]\s*\"?(\S+?)\"?\s*$", clean)
    if m:
        out["server_name"] = m.group(1)
    return out


def nats_conf_variables(text: str) -> set[str]:
    """Environment variables a nats-server configuration refers to (``$NAME``)."""
    return set(re.findall(r"\$([A-Za-z_][A-Za-z0-9_]*)", _strip_conf_comments(text)))


def nats_routes(text: str) -> list[str]:
    """The cluster routes of a nats-server configuration."""
    cluster = _block(_strip_conf_comments(text), "cluster")
    if cluster is None:
        return []
    m = re.search(r"routes\s*[:=]\s*\[(.*?)\]", cluster, re.DOTALL)
    return re.findall(r"nats(?:-route)?://[^\s,\]]+", m.group(1)) if m else []


def nats_conf_problems(where: str, text: str) -> list[str]:
    """JetStream on, with the embedded server's fsync policy and payload limit."""
    summary = nats_conf_summary(text)
    embedded = embedded_nats_settings()
    problems = []
    if summary.get("jetstream") != "enabled":
        problems.append(f"{where}: no `jetstream {{ ... }}` block: the services need JetStream")
    if summary.get("sync_interval") != embedded["sync_interval"]:
        problems.append(
            f"{where}: jetstream sync_interval is {summary.get('sync_interval')!r}, "
            f"torchrelay up runs {embedded['sync_interval']!r} (fsync every write)"
        )
    if summary.get("max_payload") != embedded.get("max_payload"):
        problems.append(
            f"{where}: max_payload is {summary.get('max_payload')!r}, the embedded "
            f"server's is {embedded.get('max_payload')!r}"
        )
    if not summary.get("store_dir"):
        problems.append(f"{where}: jetstream has no store_dir: the data would not be on a volume")
    return problems


def redis_durability_problems(where: str, argv: Sequence[str]) -> list[str]:
    """The redis-server command line has the embedded server's AOF flags."""
    flags = _flag_pairs(argv)
    return [
        f"{where}: redis-server {flag} is {flags.get(flag)!r}, torchrelay up runs {value!r}"
        for flag, value in embedded_redis_durability().items()
        if flags.get(flag) != value
    ]


# ------------------------------------------------------------------------ compose


def is_cli_job(svc: Mapping[str, Any]) -> bool:
    """A one-shot container running a ``torchrelay`` CLI verb (``provision``), not a service."""
    argv = as_argv(svc.get("command"))
    return argv[:3] == ["python", "-m", "torchrelay.cli"] and str(svc.get("restart")) == "no"


def cli_job_problem(argv: list[str]) -> str | None:
    """Why ``python -m torchrelay.cli VERB ...`` would not parse, or None."""
    from torchrelay.cli import build_parser

    try:
        build_parser().parse_args(argv[3:])
    except SystemExit:
        return f"`{' '.join(argv)}` is not a valid torchrelay command line"
    return None


def compose_torchrelay_services(compose: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Compose services that run torchrelay code (by image, build or command); one-shot CLI
    jobs (:func:`is_cli_job`) are checked apart."""
    found = {}
    for name, svc in (compose.get("services") or {}).items():
        if is_cli_job(svc):
            continue
        argv = as_argv(svc.get("command"))
        image = str(svc.get("image", ""))
        if (
            image.startswith(IMAGE_REPOSITORY)
            or "build" in svc
            or (argv and argv[0] in ("python", "python3", "torchrelay"))
        ):
            found[name] = svc
    return found


def compose_problems(compose: Mapping[str, Any], known_env: frozenset[str]) -> list[str]:
    """Image, environment, ports and healthchecks of torchrelay services, and that every
    service of contract.SERVICES is one (entry points: :func:`entry_point_problem`)."""
    problems: list[str] = []
    image = expected_image()
    ours = compose_torchrelay_services(compose)
    by_module: dict[str, str] = {}
    for name, svc in ours.items():
        where = f"docker-compose.yml service {name}"
        argv = as_argv(svc.get("command"))
        if svc.get("image") != image:
            problems.append(
                f"{where}: image {svc.get('image')!r}, expected {image!r} (one "
                "image, tagged with the package version)"
            )
        env = compose_env(svc)
        problems += unknown_env_problems(where, env, known_env)
        is_agent = argv[3:4] == ["agent"]
        if len(argv) == 3 and argv[:2] == ["python", "-m"]:
            by_module[argv[2]] = name
        required = ("NATS_URL", "TORCHRELAY_CLUSTER") if is_agent else REQUIRED_SERVICE_ENV
        problems += [
            f"{where}: {var} is not set (torchrelay up sets it for every service)"
            for var in required
            if var not in env
        ]
        if env.get("TORCHRELAY_HTTP_HOST", "0.0.0.0") != "0.0.0.0":
            problems.append(
                f"{where}: TORCHRELAY_HTTP_HOST must be 0.0.0.0 in a container "
                "or the healthcheck and other containers cannot reach it"
            )
        if argv[2:3] == ["services.api"] and "TORCHRELAY_OPERATOR_TOKEN" not in env:
            problems.append(f"{where}: the api needs TORCHRELAY_OPERATOR_TOKEN in production")
        port = _interpolated_default(env.get("TORCHRELAY_HTTP_PORT", ""))
        if not is_agent:
            problems += _compose_health_problems(where, svc, port)
        for mapping in svc.get("ports") or []:
            target = str(mapping).rsplit(":", 1)[-1].split("/")[0]
            if target != port:
                problems.append(
                    f"{where}: publishes container port {target}, but the service "
                    f"listens on TORCHRELAY_HTTP_PORT={port}"
                )
    for svc_name in SERVICES:
        if f"services.{svc_name}" not in by_module:
            problems.append(
                f"docker-compose.yml: no service runs `python -m services.{svc_name}`"
                " (every service of contract.SERVICES must be deployed)"
            )
    return problems


def _compose_health_problems(where: str, svc: Mapping[str, Any], port: str) -> list[str]:
    check = svc.get("healthcheck") or {}
    test = " ".join(as_argv(check.get("test")))
    if check.get("disable") or not test:
        return [f"{where}: no healthcheck on /readyz"]
    problems = []
    if "/readyz" not in test:
        problems.append(f"{where}: the healthcheck does not ask /readyz: {test!r}")
    if "TORCHRELAY_HTTP_PORT" not in test and f":{port}/" not in test:
        problems.append(f"{where}: the healthcheck's port is not TORCHRELAY_HTTP_PORT={port}")
    return problems


def compose_url_problems(compose: Mapping[str, Any]) -> list[str]:
    """NATS_URL/REDIS_URL of every torchrelay service point at the compose nats/redis."""
    services = compose.get("services") or {}
    problems = []
    for name, svc in compose_torchrelay_services(compose).items():
        env = compose_env(svc)
        for var, target, port in (("NATS_URL", "nats", 4222), ("REDIS_URL", "redis", 6379)):
            if var not in env:
                continue
            host, url_port = url_host_port(env[var])
            if host not in services or host != target or (url_port or port) != port:
                problems.append(
                    f"docker-compose.yml service {name}: {var} points at "
                    f"{host}:{url_port}, not the compose service {target}:{port}"
                )
    return problems


# --------------------------------------------------------------------- kubernetes


def kustomization_problems(kdir: Path) -> list[str]:
    """Every resource listed exists and parses; every manifest in the folder is listed."""
    problems = []
    kust = load_yaml(kdir / "kustomization.yaml")
    resources = kust.get("resources") or []
    for res in resources:
        path = kdir / res
        if not path.is_file():
            problems.append(f"kustomization.yaml lists {res}, which does not exist")
            continue
        for doc in load_yaml_documents(path):
            if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
                problems.append(f"{res}: a document without kind/apiVersion")
    listed = set(resources)
    for path in sorted(kdir.glob("*.yaml")):
        if path.name != "kustomization.yaml" and path.name not in listed:
            problems.append(
                f"{path.name} is not in kustomization.yaml's resources: "
                "`kubectl apply -k` would skip it"
            )
    return problems


def k8s_documents(kdir: Path) -> list[dict[str, Any]]:
    """The manifests of the kustomization, in its resources order."""
    kust = load_yaml(kdir / "kustomization.yaml")
    docs = []
    for res in kust.get("resources") or []:
        docs += load_yaml_documents(kdir / res)
    return docs


def _by_kind(docs: Sequence[Mapping[str, Any]], kind: str) -> list[Mapping[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


WORKLOAD_KINDS = ("Deployment", "DaemonSet", "StatefulSet")


def _workloads(docs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [d for d in docs if d.get("kind") in WORKLOAD_KINDS]


def _pod_spec(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    return workload["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def _configmap(docs: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, str] | None:
    for cm in _by_kind(docs, "ConfigMap"):
        if cm["metadata"]["name"] == name:
            return cm.get("data") or {}
    return None


def configmap_data(docs: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, str]:
    """The data of ConfigMap ``name``; KeyError naming it if there is none."""
    data = _configmap(docs, name)
    if data is None:
        raise KeyError(f"no ConfigMap {name} in deploy/kubernetes")
    return data


def container_env(
    docs: Sequence[Mapping[str, Any]], container: Mapping[str, Any]
) -> dict[str, str | None]:
    """The container's environment: envFrom ConfigMaps, then env (literal values; None for
    values from Secrets or the downward API)."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom") or []:
        ref = source.get("configMapRef")
        if ref:
            env.update(_configmap(docs, ref["name"]) or {})
    for item in container.get("env") or []:
        env[item["name"]] = item.get("value")
    return env


def k8s_torchrelay_containers(
    docs: Sequence[Mapping[str, Any]],
) -> list[tuple[str, Mapping[str, Any], Mapping[str, Any]]]:
    """(where, workload, container) for every container that runs torchrelay code."""
    out = []
    for wl in _workloads(docs):
        for c in _pod_spec(wl).get("containers") or []:
            argv = as_argv(c.get("command"))
            if str(c.get("image", "")).startswith(IMAGE_REPOSITORY) or (
                argv and argv[0] in ("python", "python3", "torchrelay")
            ):
                where = f"{wl['kind']}/{wl['metadata']['name']} container {c['name']}"
                out.append((where, wl, c))
    return out


def _resolve_port(container: Mapping[str, Any], port: object) -> int | None:
    if isinstance(port, int):
        return port
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    return None


def k8s_problems(
    docs: Sequence[Mapping[str, Any]], known_env: frozenset[str], kustomization: Mapping[str, Any]
) -> list[str]:
    """Images, environment, ports and probes of the torchrelay containers, and that every
    service is a Deployment and the agent a DaemonSet (entry points: entry_point_problem)."""
    problems: list[str] = []
    image = expected_image()
    deployed: dict[str, str] = {}
    agent_seen = False
    for tag in kustomization.get("images") or []:
        if tag.get("name") == IMAGE_REPOSITORY and tag.get("newTag") != package_version():
            problems.append(
                f"kustomization.yaml retags {IMAGE_REPOSITORY} to "
                f"{tag.get('newTag')!r}, not the package version {package_version()}"
            )
    for where, wl, c in k8s_torchrelay_containers(docs):
        argv = as_argv(c.get("command")) + as_argv(c.get("args"))
        if c.get("image") != image:
            problems.append(f"{where}: image {c.get('image')!r}, expected {image!r}")
        env = container_env(docs, c)
        problems += unknown_env_problems(where, env, known_env)
        for text in [*argv, *(str(v) for v in env.values() if v)]:
            problems += [
                f"{where}: $({ref}) is not an environment variable of the container, "
                "so Kubernetes would pass it literally"
                for ref in ENV_REF.findall(text)
                if ref not in env
            ]
        is_agent = argv[3:4] == ["agent"]
        if is_agent:
            agent_seen = True
            problems += _agent_workload_problems(where, wl, c)
            continue
        if wl["kind"] == "Deployment" and len(argv) == 3:
            deployed[argv[2]] = where
        problems += [
            f"{where}: {var} is not set (torchrelay up sets it for every service)"
            for var in REQUIRED_SERVICE_ENV
            if var not in env
        ]
        if argv[2:3] == ["services.api"] and "TORCHRELAY_OPERATOR_TOKEN" not in env:
            problems.append(f"{where}: the api needs TORCHRELAY_OPERATOR_TOKEN in production")
        problems += _k8s_port_problems(where, c, env)
    for svc_name in SERVICES:
        if f"services.{svc_name}" not in deployed:
            problems.append(
                f"deploy/kubernetes: no Deployment runs `python -m services.{svc_name}`"
            )
    if not agent_seen:
        problems.append("deploy/kubernetes: no DaemonSet runs the detector agent")
    return problems


def _agent_workload_problems(where: str, wl: Mapping[str, Any], c: Mapping[str, Any]) -> list[str]:
    problems = []
    if wl["kind"] != "DaemonSet":
        problems.append(f"{where}: the detector agent must be a DaemonSet (one per node)")
    node_name = next((e for e in c.get("env") or [] if e["name"] == "NODE_NAME"), None)
    field = ((node_name or {}).get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
    if field != "spec.nodeName":
        problems.append(f"{where}: NODE_NAME must come from the downward API (spec.nodeName)")
    return problems


def _k8s_port_problems(
    where: str, c: Mapping[str, Any], env: Mapping[str, str | None]
) -> list[str]:
    problems = []
    raw = env.get("TORCHRELAY_HTTP_PORT")
    port = int(raw) if raw and raw.isdigit() else None
    if port is None:
        return [f"{where}: TORCHRELAY_HTTP_PORT is not a literal port: {raw!r}"]
    if env.get("TORCHRELAY_HTTP_HOST") != "0.0.0.0":
        problems.append(f"{where}: TORCHRELAY_HTTP_HOST must be 0.0.0.0 for probes to reach it")
    declared = [int(p["containerPort"]) for p in c.get("ports") or []]
    if port not in declared:
        problems.append(
            f"{where}: containerPort {declared} does not include TORCHRELAY_HTTP_PORT={port}"
        )
    for probe_name, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = (c.get(probe_name) or {}).get("httpGet")
        if not get:
            problems.append(f"{where}: no {probe_name} httpGet {path}")
            continue
        if get.get("path") != path:
            problems.append(f"{where}: {probe_name} asks {get.get('path')!r}, not {path}")
        if _resolve_port(c, get.get("port")) != port:
            problems.append(
                f"{where}: {probe_name} port {get.get('port')!r} is not TORCHRELAY_HTTP_PORT={port}"
            )
    return problems


def k8s_service_problems(docs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every Service selects a workload and targets a port its containers declare; the api has
    one that reaches TORCHRELAY_HTTP_PORT."""
    problems = []
    api_served = False
    for svc in _by_kind(docs, "Service"):
        name = svc["metadata"]["name"]
        selector = svc["spec"].get("selector") or {}
        matches = [
            wl
            for wl in _workloads(docs)
            if selector.items() <= (wl["spec"]["template"]["metadata"].get("labels") or {}).items()
        ]
        if not matches:
            problems.append(f"Service/{name}: its selector {selector} matches no workload")
            continue
        for p in svc["spec"].get("ports") or []:
            target = p.get("targetPort", p.get("port"))
            for wl in matches:
                containers = _pod_spec(wl).get("containers") or []
                resolved = [_resolve_port(c, target) for c in containers]
                if not any(
                    r is not None and r in [int(cp["containerPort"]) for cp in c.get("ports") or []]
                    for r, c in zip(resolved, containers, strict=True)
                ):
                    problems.append(
                        f"Service/{name}: targetPort {target!r} is no port of "
                        f"{wl['kind']}/{wl['metadata']['name']}"
                    )
                for r, c in zip(resolved, containers, strict=True):
                    argv = as_argv(c.get("command"))
                    if argv[2:3] == ["services.api"]:
                        env = container_env(docs, c)
                        if r == int(env.get("TORCHRELAY_HTTP_PORT") or -1):
                            api_served = True
    if not api_served:
        problems.append("deploy/kubernetes: no Service reaches the api's TORCHRELAY_HTTP_PORT")
    return problems


def k8s_secret_problems(docs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The Secret holds placeholders only; every secretKeyRef names a key it has; the ConfigMap
    holds no secrets."""
    problems = []
    secrets: dict[str, Mapping[str, str]] = {}
    for s in _by_kind(docs, "Secret"):
        name = s["metadata"]["name"]
        if s.get("data"):
            problems.append(
                f"Secret/{name}: `data:` holds encoded values; the base ships "
                f"placeholders in stringData only"
            )
        string_data = s.get("stringData") or {}
        secrets[name] = string_data
        for key, value in string_data.items():
            if PLACEHOLDER not in str(value):
                problems.append(
                    f"Secret/{name}: {key} is not a {PLACEHOLDER} placeholder; a "
                    "real secret must not be committed"
                )
        if "nats.creds" in string_data and (
            string_data["nats.creds"] != f"{string_data.get('nats-user')}:"
            f"{string_data.get('nats-password')}"
        ):
            problems.append(f"Secret/{name}: nats.creds is not `<nats-user>:<nats-password>`")
    for wl in _workloads(docs):
        spec = _pod_spec(wl)
        for c in spec.get("containers") or []:
            for item in c.get("env") or []:
                ref = (item.get("valueFrom") or {}).get("secretKeyRef")
                if ref and ref.get("key") not in secrets.get(ref.get("name"), {}):
                    problems.append(
                        f"{wl['kind']}/{wl['metadata']['name']}: env {item['name']} "
                        f"refers to {ref.get('name')}/{ref.get('key')}, which "
                        "does not exist"
                    )
        for vol in spec.get("volumes") or []:
            sec = vol.get("secret")
            if sec:
                for item in sec.get("items") or []:
                    if item["key"] not in secrets.get(sec.get("secretName"), {}):
                        problems.append(
                            f"{wl['kind']}/{wl['metadata']['name']}: volume "
                            f"{vol['name']} mounts missing key {item['key']}"
                        )
    secret_settings = secret_env_names()
    for cm in _by_kind(docs, "ConfigMap"):
        for key, value in (cm.get("data") or {}).items():
            if (
                SECRET_NAME_PATTERN.search(key) and str(value).lower() not in ("true", "false")
            ) or key in secret_settings:
                problems.append(
                    f"ConfigMap/{cm['metadata']['name']}: {key} looks like a "
                    "secret; secrets go in the Secret"
                )
            if re.search(r"://[^/\s]*:[^/\s]*@", str(value)):
                problems.append(
                    f"ConfigMap/{cm['metadata']['name']}: {key} has a password in a URL"
                )
    return problems


def k8s_credentials_mount_problems(docs: Sequence[Mapping[str, Any]]) -> list[str]:
    """TORCHRELAY_NATS_CREDENTIALS names a file that a Secret volume really mounts."""
    problems = []
    for where, wl, c in k8s_torchrelay_containers(docs):
        path = container_env(docs, c).get("TORCHRELAY_NATS_CREDENTIALS")
        if not path:
            continue
        spec = _pod_spec(wl)
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        ok = False
        for mount in c.get("volumeMounts") or []:
            vol = volumes.get(mount["name"], {})
            items = [i["path"] for i in (vol.get("secret") or {}).get("items") or []]
            if any(f"{mount['mountPath'].rstrip('/')}/{i}" == path for i in items):
                ok = True
        if not ok:
            problems.append(
                f"{where}: TORCHRELAY_NATS_CREDENTIALS={path} is not a file of a "
                "mounted Secret volume"
            )
    return problems


def k8s_nats_problems(docs: Sequence[Mapping[str, Any]]) -> list[str]:
    """A 3-server JetStream cluster, R3 streams, fsync always, routes that resolve."""
    problems = []
    stateful = [s for s in _by_kind(docs, "StatefulSet") if s["metadata"]["name"] == "nats"]
    if not stateful:
        return ["deploy/kubernetes: no StatefulSet nats"]
    sts = stateful[0]
    replicas = int(sts["spec"].get("replicas", 1))
    if replicas != 3:
        problems.append(f"StatefulSet/nats has {replicas} replicas, not 3")
    config = _configmap(docs, "nats-config") or {}
    text = config.get("nats.conf", "")
    problems += nats_conf_problems("ConfigMap/nats-config nats.conf", text)
    service_name = sts["spec"].get("serviceName")
    expected_routes = {f"{sts['metadata']['name']}-{i}.{service_name}" for i in range(replicas)}
    route_hosts = {urlsplit(r).hostname for r in nats_routes(text)}
    if route_hosts != expected_routes:
        problems.append(
            f"nats.conf cluster routes {sorted(h or '' for h in route_hosts)} are "
            f"not the StatefulSet's pods {sorted(expected_routes)}"
        )
    if nats_conf_summary(text).get("server_name") != "$POD_NAME":
        problems.append(
            "nats.conf server_name must be $POD_NAME: JetStream clustering needs a "
            "unique, stable name per server"
        )
    container = _pod_spec(sts)["containers"][0]
    env_names = {e["name"] for e in container.get("env") or []}
    missing = nats_conf_variables(text) - env_names
    if missing:
        problems.append(
            f"nats.conf refers to {sorted(missing)}, which the nats container's "
            "environment does not set"
        )
    store = nats_conf_summary(text).get("store_dir", "")
    claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates") or []}
    if not any(
        m["name"] in claims and store.startswith(m["mountPath"])
        for m in container.get("volumeMounts") or []
    ):
        problems.append(f"nats.conf store_dir {store!r} is not on a PersistentVolumeClaim")
    for where, _wl, c in k8s_torchrelay_containers(docs):
        env = container_env(docs, c)
        stream_replicas = env.get("TORCHRELAY_STREAM_REPLICAS")
        if stream_replicas != str(replicas):
            problems.append(
                f"{where}: TORCHRELAY_STREAM_REPLICAS={stream_replicas}, but the "
                f"NATS cluster has {replicas} servers (R{replicas} streams)"
            )
        if env.get("NATS_URL"):
            host = url_host_port(str(env["NATS_URL"]))[0]
            if host not in {s["metadata"]["name"] for s in _by_kind(docs, "Service")}:
                problems.append(f"{where}: NATS_URL host {host} is no Service")
    return problems


def k8s_redis_problems(docs: Sequence[Mapping[str, Any]]) -> list[str]:
    """One Redis primary with the embedded AOF flags, its --dir on a PVC."""
    stateful = [s for s in _by_kind(docs, "StatefulSet") if s["metadata"]["name"] == "redis"]
    if not stateful:
        return ["deploy/kubernetes: no StatefulSet redis"]
    sts = stateful[0]
    problems = []
    if int(sts["spec"].get("replicas", 1)) != 1:
        problems.append("StatefulSet/redis must have 1 replica: a single primary (README)")
    c = _pod_spec(sts)["containers"][0]
    argv = as_argv(c.get("command")) + as_argv(c.get("args"))
    problems += redis_durability_problems("StatefulSet/redis", argv)
    data_dir = _flag_pairs(argv).get("--dir", "")
    claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates") or []}
    if not any(
        m["name"] in claims and m["mountPath"] == data_dir for m in c.get("volumeMounts") or []
    ):
        problems.append(f"StatefulSet/redis: --dir {data_dir!r} is not a PersistentVolumeClaim")
    services = {s["metadata"]["name"] for s in _by_kind(docs, "Service")}
    for where, _wl, tc in k8s_torchrelay_containers(docs):
        url = container_env(docs, tc).get("REDIS_URL")
        if url and url_host_port(url)[0] not in services:
            problems.append(f"{where}: REDIS_URL host {url_host_port(url)[0]} is no Service")
    return problems


def selector_problems(docs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each workload's selector matches its own pod template's labels."""
    problems = []
    for wl in _workloads(docs):
        selector = wl["spec"]["selector"]["matchLabels"]
        labels = wl["spec"]["template"]["metadata"].get("labels") or {}
        if not selector.items() <= labels.items():
            problems.append(
                f"{wl['kind']}/{wl['metadata']['name']}: selector {selector} does "
                f"not match its pod labels {labels}"
            )
    return problems


# --------------------------------------------------------------------- Dockerfile


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")),
    )
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerignore_patterns(text: str) -> list[str]:
    return [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def is_dockerignored(path: str, patterns: Sequence[str]) -> bool:
    """Whether ``path`` (or a parent folder) is excluded by .dockerignore (no ``!`` rules)."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        pat = pattern.removeprefix("/").removeprefix("**/")
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(Path(p).name, pat) for p in prefixes):
            return True
    return False


# ------------------------------------------------------------ settings validation


def settings_class_for(argv: Sequence[str]) -> type[CommonSettings]:
    """The settings class the process of ``argv`` loads.

    The detector agent loads CommonSettings; a service loads the most derived settings class
    defined in its own package (e.g. ApiSettings), else ServiceSettings.
    """
    if argv[3:4] == ["agent"]:
        return CommonSettings
    package = argv[2] if len(argv) > 2 else ""
    own = [
        c
        for c in settings_classes()
        if c.__module__.startswith(f"{package}.") and issubclass(c, CommonSettings)
    ]
    own = [c for c in own if not any(o is not c and issubclass(o, c) for o in own)]
    if len(own) == 1 and issubclass(own[0], CommonSettings):
        return own[0]
    return ServiceSettings


def k8s_resolved_env(
    docs: Sequence[Mapping[str, Any]], container: Mapping[str, Any], secrets: Mapping[str, str]
) -> dict[str, str]:
    """The environment the container would really get: Secret keys replaced by ``secrets``
    (key -> value), the downward API by a sample node name, and ``$(VAR)`` expanded."""
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        ref = source.get("configMapRef")
        if ref:
            env.update(_configmap(docs, ref["name"]) or {})
    for item in container.get("env") or []:
        value_from = item.get("valueFrom") or {}
        if "value" in item:
            value = ENV_REF.sub(lambda m: env.get(m.group(1), m.group(0)), str(item["value"]))
        elif "secretKeyRef" in value_from:
            value = secrets[value_from["secretKeyRef"]["key"]]
        else:
            value = "gpu-node-1"
        env[item["name"]] = value
    return env


def compose_resolved_env(env: Mapping[str, str], variables: Mapping[str, str]) -> dict[str, str]:
    """Compose interpolation: ``${VAR}``, ``${VAR:?msg}`` from ``variables``; ``${VAR:-d}``
    from ``variables`` else the default."""

    def sub(m: re.Match[str]) -> str:
        name, op, rest = m.group(1), m.group(2) or "", m.group(3) or ""
        if name in variables:
            return variables[name]
        if op in (":-", "-"):
            return rest
        raise KeyError(f"compose needs {name} set ({rest or 'no default'})")

    pattern = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
    return {k: pattern.sub(sub, v) for k, v in env.items()}
