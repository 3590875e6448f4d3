"""The deployment files of jobs across hosts against the launcher: the JobSet and its example
Secret (deploy/kubernetes/training/) and the Slurm batch script (deploy/slurm/).

Neither Kubernetes nor Slurm runs here, so each `torchrelay run` command line the files write
is taken as the pod or node would run it -- Kubernetes' ``$(VAR)`` expansion and downward
API with sample values, the batch script run by bash with stand-ins for ``srun`` and
``scontrol`` that record what each node would start -- and then parsed by torchrelay's own
parser and planned by ``host_plan``/``options_from_args`` with the environment the launcher
would see. The checks return problems (empty = fine) so the last tests can break a copy of
each file and show that the checks name the mistake.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import functools
import io
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from tests.unit.deploy import checks
from torchrelay.auth import ROLES
from torchrelay.cli import build_parser
from torchrelay.launcher import (
    EXIT_HOST_REFUSED,
    EXIT_USAGE,
    LauncherError,
    Options,
    options_from_args,
)
from torchrelay.launcher._args import host_plan

TRAINING_DIR = checks.K8S_DIR / "training"
JOBSET_FILE = TRAINING_DIR / "jobset.yaml"
SECRET_FILE = TRAINING_DIR / "secret.example.yaml"
SBATCH_FILE = checks.REPO / "deploy" / "slurm" / "torchrelay.sbatch"
LIBS = checks.REPO / "libs" / "torchrelay"
LAUNCHER_SOURCES = LIBS / "launcher"

# What JobSet and the Job controller put on every pod (kubernetes-sigs/jobset, batch/v1).
JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
GPU_RESOURCE = "nvidia.com/gpu"
# The replicated jobs of the JobSet: the worker hosts' pods and the spare hosts'.
REPLICATED_JOBS = ("workers", "spares")
# Read by the launcher itself; the files must set them (the test greps the launcher for each).
LAUNCHER_ENV = (
    "TORCHRELAY_JOB_CLAIM",
    "NATS_URL",
    "TORCHRELAY_NATS_CREDENTIALS",
    "TORCHRELAY_ADVERTISE_HOST",
)
ENV_NAME = re.compile(r"^[A-Z][A-Z0-9]*_[A-Z0-9_]+$")
K8S_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _find(problems: list[str], *fragments: str) -> list[str]:
    return [p for p in problems if all(f in p for f in fragments)]


# ------------------------------------------------------------------ what the code reads


def _receiver(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _literal_name(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value if ENV_NAME.match(node.value) else None
    return None


def _reads_env(node: ast.AST, envish: set[str]) -> ast.expr | None:
    """The key expression of an environment read, or None if ``node`` is none."""
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        by_method = isinstance(func, ast.Attribute) and (
            (func.attr in ("get", "pop") and _receiver(func.value) in envish)
            or func.attr == "getenv"
        )
        by_helper = isinstance(func, ast.Name) and func.id in ("env", "getenv")
        return node.args[0] if by_method or by_helper else None
    if isinstance(node, ast.Subscript) and _receiver(node.value) in envish:
        return node.slice
    if (
        isinstance(node, ast.Compare)
        and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
        and any(_receiver(c) in envish for c in node.comparators)
    ):
        return node.left
    return None


def _env_reads(tree: ast.AST) -> set[str]:
    """Names a module reads from its environment: ``os.environ.get("X")``, ``env.get("X")``,
    ``environ["X"]``, ``"X" in env``, ``os.getenv("X")`` and helpers called ``env("X")``."""
    envish = {"environ", "env", "environment"}
    found = {_literal_name(_reads_env(node, envish)) for node in ast.walk(tree)}
    return {name for name in found if name}


@functools.cache
def env_read_in(folder: Path) -> frozenset[str]:
    """The environment variables the code under ``folder`` reads (its source, parsed now)."""
    names: set[str] = set()
    for path in sorted(folder.rglob("*.py")):
        names |= _env_reads(ast.parse(path.read_text(), str(path)))
    return frozenset(names)


@functools.cache
def env_read_by_torchrelay() -> frozenset[str]:
    """What the launcher, the agent and the settings classes read."""
    return env_read_in(LIBS) | checks.known_env_names()


@contextlib.contextmanager
def launcher_environment(env: Mapping[str, str]) -> Iterator[None]:
    """This process's environment as the launcher would see it: ``env`` over the test's own,
    without any torchrelay or NATS setting of the machine running the tests."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRELAY_", "NATS_"))}
    with mock.patch.dict(os.environ, {**keep, **env}, clear=True):
        yield


@functools.cache
def launcher_role() -> str:
    """The NATS role whose credential ``torchrelay run`` uses: asked of options_from_args
    with a stack.json that names a different file for every role."""
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        creds = {role: str(home / role) for role in ROLES}
        (home / "stack.json").write_text(
            json.dumps({"nats_url": "nats://127.0.0.1:4222", "credentials": creds})
        )
        args = build_parser().parse_args(["run", "--nproc", "1", "-m", "json"])
        with launcher_environment({"TORCHRELAY_HOME": str(home)}):
            opts = options_from_args(args)
    assert opts.credentials is not None
    return Path(opts.credentials).name


# -------------------------------------------------------------- one launcher, one job


@dataclass
class Launch:
    """One `torchrelay run` as a pod or node would start it."""

    where: str
    argv: list[str]
    env: dict[str, str]
    node: str  # the host's name as its detector node agent reports it
    cluster: str  # the agents' TORCHRELAY_CLUSTER
    address: str | None = None  # where the other hosts reach it (None: the launcher finds it)
    gpus: int | None = None  # GPUs the pod or node has for it


def launch_problems(launch: Launch) -> tuple[list[str], Options | None]:
    """Parse ``launch`` with torchrelay's parser and plan it as the launcher would."""
    where, argv = launch.where, launch.argv
    if argv[:2] != ["torchrelay", "run"]:
        return [f"{where}: runs {shlex.join(argv)!r}, not `torchrelay run`"], None
    leftover = [a for a in argv if checks.ENV_REF.search(a)]
    if leftover:
        return [f"{where}: {leftover} would reach the launcher unexpanded"], None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(argv[1:])
    except SystemExit:
        why = (err.getvalue().strip().splitlines() or ["?"])[-1]
        return [f"{where}: torchrelay's parser rejects {shlex.join(argv[1:])!r}: {why}"], None
    with launcher_environment(launch.env):
        try:
            plan = host_plan(args, args.job_id)
            opts = options_from_args(args)
        except LauncherError as exc:
            return [f"{where}: torchrelay run refuses it: {exc}"], None
    if plan is None or opts.host is None:
        return [f"{where}: is the one-host shortcut, not one host of a job across hosts"], None
    return [], opts


def job_problems(workers: Sequence[Launch], spares: Sequence[Launch]) -> list[str]:
    """The launchers of one job: N worker hosts with ranks 0..N-1 and --nnodes N, spare hosts
    of their own, one job id, tenant, claim, control plane and training command, each host
    named as its node agent names it."""
    problems: list[str] = []
    planned: list[tuple[Launch, Options, bool]] = []
    for launches, spare in ((workers, False), (spares, True)):
        for launch in launches:
            found, opts = launch_problems(launch)
            problems += found
            if opts is not None:
                planned.append((launch, opts, spare))
    if not workers:
        problems.append("no worker host runs a launcher")
    if not spares:
        problems.append("no spare host runs `torchrelay run --spare`")
    ranks = []
    for launch, opts, spare in planned:
        host, where = opts.host, launch.where
        assert host is not None
        if host.spare_host != spare:
            kind = "a spare host (--spare)" if spare else "a worker host"
            problems.append(f"{where}: planned as the other kind of host; expected {kind}")
            continue
        if not spare:
            ranks.append(host.node_rank)
            if host.nnodes != len(workers):
                problems.append(
                    f"{where}: --nnodes {host.nnodes}, but {len(workers)} worker hosts run "
                    "a launcher"
                )
        if host.node != launch.node:
            problems.append(
                f"{where}: the launcher calls its host {host.node!r}, the detector node agent "
                f"reports {launch.node!r} (a fault there would reach no rank)"
            )
        if opts.cluster != launch.cluster:
            problems.append(
                f"{where}: TORCHRELAY_CLUSTER {opts.cluster!r}, the node agents' is "
                f"{launch.cluster!r}"
            )
        if launch.address is not None and host.advertise_host != launch.address:
            problems.append(
                f"{where}: advertises {host.advertise_host!r} to the other hosts, not its "
                f"address {launch.address!r}"
            )
        if launch.gpus is not None and launch.gpus != host.nproc_per_node:
            problems.append(
                f"{where}: --nproc-per-node {host.nproc_per_node} on {launch.gpus} GPU(s): "
                "take every GPU of the node, one slot each"
            )
        if host.claim is None:
            problems.append(f"{where}: no TORCHRELAY_JOB_CLAIM: the hosts cannot share the job")
        if host.simulate_gpus:
            problems.append(f"{where}: --simulate-gpus on a real host")
        if not opts.credentials:
            problems.append(f"{where}: no NATS credential (TORCHRELAY_NATS_CREDENTIALS)")
    if sorted(r for r in ranks if r is not None) != list(range(len(workers))) or None in ranks:
        problems.append(f"the worker hosts' node ranks {ranks} are not 0..{len(workers) - 1}")
    for what, value in (
        ("job id", lambda o: o.job_id),
        ("tenant", lambda o: o.tenant),
        ("claim", lambda o: o.host.claim),
        ("NATS_URL", lambda o: o.nats_url),
        ("training command", lambda o: (o.module, o.script, tuple(o.script_args))),
    ):
        seen = {value(o) for _, o, _ in planned}
        if len(seen) > 1:
            shown = f"{len(seen)} values" if what == "claim" else sorted(map(str, seen))
            problems.append(f"the launchers of the job do not share one {what}: {shown}")
    nodes = [launch.node for launch, _, _ in planned]
    if len(set(nodes)) != len(nodes):
        problems.append(f"two launchers on one host {nodes}: one launcher per host")
    return problems


# ----------------------------------------------------------------------- Kubernetes


def k8s_expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables replaced, ``$$`` escapes a ``$``,
    an undefined reference kept as it is."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return K8S_REF.sub(sub, text)


def kubelet_env(
    where: str,
    container: Mapping[str, Any],
    fields: Mapping[str, str],
    secret_values: Mapping[tuple[str, str], str],
) -> tuple[dict[str, str], list[str]]:
    """The container's environment as the kubelet builds it: literal values (with ``$(VAR)``
    of the variables before them), the downward API's ``fields`` and Secret keys."""
    env: dict[str, str] = {}
    problems = []
    if container.get("envFrom"):
        problems.append(f"{where}: envFrom: no ConfigMap ships with the training manifests")
    for item in container.get("env") or []:
        source = item.get("valueFrom") or {}
        if "value" in item:
            env[item["name"]] = k8s_expand(str(item["value"]), env)
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            if path not in fields:
                problems.append(f"{where}: env {item['name']}: no downward API field {path}")
            env[item["name"]] = fields.get(path, "")
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            key = (ref.get("name"), ref.get("key"))
            if key not in secret_values:
                problems.append(f"{where}: env {item['name']}: no Secret key {key}")
            env[item["name"]] = secret_values.get(key, "")
        else:
            problems.append(f"{where}: env {item['name']}: unsupported source {source}")
    return env, problems


@dataclass
class NodeAgent:
    """What the detector node agent's DaemonSet says about the nodes it runs on."""

    node_arg: str  # its --node argument, e.g. $(NODE_NAME)
    field_env: dict[str, str]  # its variables from the downward API: name -> fieldPath
    cluster: str
    node_selector: dict[str, str]

    def node_name(self, node_fields: Mapping[str, str]) -> str:
        """The name it reports for a node whose node-level fields are ``node_fields``."""
        env = {
            n: node_fields.get(p, f"<{p} of the agent's own pod>")
            for n, p in self.field_env.items()
        }
        return k8s_expand(self.node_arg, env)


def node_agent(control_plane: Sequence[Mapping[str, Any]]) -> NodeAgent:
    """The detector node agent of deploy/kubernetes."""
    for _where, wl, c in checks.k8s_torchrelay_containers(control_plane):
        argv = checks.as_argv(c.get("command")) + checks.as_argv(c.get("args"))
        if argv[3:4] != ["agent"]:
            continue
        return NodeAgent(
            node_arg=argv[argv.index("--node") + 1],
            field_env={
                e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
                for e in c.get("env") or []
                if (e.get("valueFrom") or {}).get("fieldRef")
            },
            cluster=str(
                checks.container_env(control_plane, c).get("TORCHRELAY_CLUSTER") or "local"
            ),
            node_selector=dict(wl["spec"]["template"]["spec"].get("nodeSelector") or {}),
        )
    raise AssertionError("deploy/kubernetes runs no detector node agent")


def pod_launches(
    jobset: Mapping[str, Any],
    secret_values: Mapping[tuple[str, str], str],
    control_plane: Sequence[Mapping[str, Any]],
) -> tuple[dict[str, list[Launch]], list[str]]:
    """Every pod of the JobSet as a Launch, by replicated job, each on a node of its own."""
    agent = node_agent(control_plane)
    name = jobset["metadata"]["name"]
    out: dict[str, list[Launch]] = {}
    problems: list[str] = []
    host = 0
    for rjob in jobset["spec"].get("replicatedJobs") or []:
        job = rjob["template"]["spec"]
        runs = [
            c
            for c in job["template"]["spec"].get("containers") or []
            if checks.as_argv(c.get("command"))[:2] == ["torchrelay", "run"]
        ]
        if len(runs) != 1:
            problems.append(f"JobSet/{name} {rjob['name']}: {len(runs)} launcher containers")
            continue
        c = runs[0]
        gpus = (c.get("resources") or {}).get("limits", {}).get(GPU_RESOURCE)
        out[rjob["name"]] = []
        for job_index in range(int(rjob.get("replicas", 1))):
            for index in range(int(job.get("parallelism", 1))):
                where = f"JobSet/{name} {rjob['name']} pod {job_index}-{index}"
                node = {"spec.nodeName": f"gpu-node-{host}", "status.hostIP": f"192.168.0.{host}"}
                meta = {
                    JOBSET_NAME_LABEL: name,
                    "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                    "jobset.sigs.k8s.io/job-index": str(job_index),
                    COMPLETION_INDEX_KEY: str(index),
                }
                fields = {
                    **node,
                    "status.podIP": f"10.8.0.{host}",
                    "metadata.name": f"{name}-{rjob['name']}-{job_index}-{index}-x{host}",
                    "metadata.namespace": "training",
                    **{f"metadata.labels['{k}']": v for k, v in meta.items()},
                    **{f"metadata.annotations['{k}']": v for k, v in meta.items()},
                }
                env, found = kubelet_env(where, c, fields, secret_values)
                problems += found
                argv = checks.as_argv(c.get("command")) + checks.as_argv(c.get("args"))
                out[rjob["name"]].append(
                    Launch(
                        where=where,
                        argv=[k8s_expand(a, env) for a in argv],
                        env=env,
                        node=agent.node_name(node),
                        cluster=agent.cluster,
                        address=fields["status.podIP"],
                        gpus=None if gpus is None else int(gpus),
                    )
                )
                host += 1
    return out, problems


def as_workloads(jobset: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each replicated job's pod template as a Deployment, for the checks of checks.py that
    read workloads (Secret keys, mounted credentials)."""
    return [
        {
            "kind": "Deployment",
            "metadata": {"name": f"{jobset['metadata']['name']}-{rjob['name']}"},
            "spec": {
                "selector": {"matchLabels": {}},
                "template": rjob["template"]["spec"]["template"],
            },
        }
        for rjob in jobset["spec"].get("replicatedJobs") or []
    ]


def jobset_shape_problems(
    jobset: Mapping[str, Any], control_plane: Sequence[Mapping[str, Any]]
) -> list[str]:
    """A JobSet of a `workers` and a `spares` replicated job whose pods start together, are
    never restarted in place or replaced, run one per node beside a node agent, from the
    torchrelay image."""
    if jobset.get("apiVersion") != JOBSET_API_VERSION or jobset.get("kind") != "JobSet":
        return [
            f"{jobset.get('apiVersion')}/{jobset.get('kind')} is no {JOBSET_API_VERSION} JobSet"
        ]
    name = jobset["metadata"]["name"]
    spec = jobset["spec"]
    problems = []
    agent_selector = node_agent(control_plane).node_selector
    network = spec.get("network") or {}
    if network.get("enableDNSHostnames") is not True:
        problems.append(f"JobSet/{name}: network.enableDNSHostnames is not true (headless Service)")
    if (spec.get("failurePolicy") or {}).get("maxRestarts", 0) != 0:
        problems.append(f"JobSet/{name}: a restart would bring the same job id's hosts again")
    rjobs = {r["name"]: r for r in spec.get("replicatedJobs") or []}
    if set(rjobs) != set(REPLICATED_JOBS):
        problems.append(
            f"JobSet/{name}: replicated jobs {sorted(rjobs)}, not {sorted(REPLICATED_JOBS)}"
        )
    labels_of = {
        r: {
            **(j["template"]["spec"]["template"]["metadata"].get("labels") or {}),
            JOBSET_NAME_LABEL: name,
        }
        for r, j in rjobs.items()
    }
    for rname, rjob in rjobs.items():
        where = f"JobSet/{name} {rname}"
        job = rjob["template"]["spec"]
        pod = job["template"]["spec"]
        if job.get("completionMode", "Indexed") != "Indexed":
            problems.append(f"{where}: completionMode {job['completionMode']}, not Indexed")
        if job.get("completions", 1) != job.get("parallelism", 1):
            problems.append(
                f"{where}: parallelism {job.get('parallelism', 1)} < completions "
                f"{job.get('completions', 1)}: hosts would come one after another"
            )
        if pod.get("restartPolicy") != "Never":
            problems.append(
                f"{where}: restartPolicy {pod.get('restartPolicy')!r} (JobSet's default is "
                "OnFailure): a launcher restarted in place joins twice and is refused"
            )
        if job.get("backoffLimitPerIndex") != 0:
            problems.append(f"{where}: backoffLimitPerIndex is not 0: a lost host is replaced")
        rules = (job.get("podFailurePolicy") or {}).get("rules") or []
        if not any(
            r.get("action") == "FailJob"
            and (r.get("onExitCodes") or {}).get("operator") == "In"
            and {EXIT_USAGE, EXIT_HOST_REFUSED}
            <= set((r.get("onExitCodes") or {}).get("values", []))
            for r in rules
        ):
            problems.append(
                f"{where}: no podFailurePolicy FailJob on exits {EXIT_USAGE} (usage) and "
                f"{EXIT_HOST_REFUSED} (host refused)"
            )
        selector = pod.get("nodeSelector") or {}
        if not agent_selector.items() <= selector.items():
            problems.append(
                f"{where}: nodeSelector {selector} does not keep it on the node agent's "
                f"nodes {agent_selector}"
            )
        terms = (pod.get("affinity") or {}).get("podAntiAffinity", {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        ) or []
        if not any(
            t.get("topologyKey") == HOSTNAME_TOPOLOGY
            and all(
                (t.get("labelSelector") or {}).get("matchLabels", {}).items() <= labels.items()
                for labels in labels_of.values()
            )
            and (t.get("labelSelector") or {}).get("matchLabels")
            for t in terms
        ):
            problems.append(f"{where}: no podAntiAffinity keeps the JobSet's pods one per node")
        for c in pod.get("containers") or []:
            if c.get("image") != checks.expected_image():
                problems.append(
                    f"{where}: image {c.get('image')!r}, not {checks.expected_image()!r}"
                )
            problem = checks.entry_point_problem(checks.as_argv(c.get("command")))
            if problem:
                problems.append(f"{where}: {problem}")
    return problems


def k8s_env_name_problems(jobset: Mapping[str, Any]) -> list[str]:
    """Every variable a launcher container sets is read by torchrelay, or only feeds a
    ``$(VAR)`` of the command, or is in checks.ENV_ALLOWLIST."""
    problems = []
    read = env_read_by_torchrelay()
    for wl in as_workloads(jobset):
        for c in wl["spec"]["template"]["spec"].get("containers") or []:
            text = " ".join(checks.as_argv(c.get("command")) + checks.as_argv(c.get("args")))
            expanded = set(checks.ENV_REF.findall(text))
            for item in c.get("env") or []:
                n = item["name"]
                if n not in read and n not in expanded and n not in checks.ENV_ALLOWLIST:
                    problems.append(
                        f"{wl['metadata']['name']}: env {n} is read by no torchrelay code and "
                        "used by no $(VAR) of the command"
                    )
    return problems


def jobset_problems(
    jobset: Mapping[str, Any],
    secret_docs: Sequence[Mapping[str, Any]],
    secret_values: Mapping[tuple[str, str], str],
    control_plane: Sequence[Mapping[str, Any]],
) -> list[str]:
    """Everything above for one JobSet and its Secret."""
    problems = jobset_shape_problems(jobset, control_plane)
    launches, found = pod_launches(jobset, secret_values, control_plane)
    problems += found
    problems += job_problems(launches.get("workers", []), launches.get("spares", []))
    problems += k8s_env_name_problems(jobset)
    workloads = as_workloads(jobset)
    problems += checks.k8s_secret_problems([*secret_docs, *workloads])
    problems += checks.k8s_credentials_mount_problems(workloads)
    return problems


@pytest.fixture(scope="module")
def jobset() -> dict[str, Any]:
    docs = checks.load_yaml_documents(JOBSET_FILE)
    assert len(docs) == 1, "jobset.yaml holds the JobSet only"
    return docs[0]


@pytest.fixture(scope="module")
def secret_docs() -> list[dict[str, Any]]:
    return checks.load_yaml_documents(SECRET_FILE)


@pytest.fixture(scope="module")
def real_secret_values(secret_docs: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """The example Secret's keys with values of real length (its placeholders are refused)."""
    return {
        (s["metadata"]["name"], key): secrets.token_urlsafe(24)
        for s in secret_docs
        for key in s.get("stringData") or {}
    }


def test_the_jobset_is_a_jobset_of_workers_and_spares(
    jobset: dict[str, Any], k8s_docs: list[dict[str, Any]]
) -> None:
    assert checks.load_yaml(JOBSET_FILE)["apiVersion"] == JOBSET_API_VERSION
    assert jobset_shape_problems(jobset, k8s_docs) == []


def test_each_pod_runs_a_launcher_that_torchrelay_parses_and_plans(
    jobset: dict[str, Any],
    k8s_docs: list[dict[str, Any]],
    real_secret_values: dict[tuple[str, str], str],
) -> None:
    launches, problems = pod_launches(jobset, real_secret_values, k8s_docs)
    assert problems == []
    assert job_problems(launches["workers"], launches["spares"]) == []
    for launch in launches["workers"] + launches["spares"]:
        _, opts = launch_problems(launch)
        assert opts is not None
        assert opts.host is not None
        assert opts.host.spare_host == (launch in launches["spares"]), launch.where


def test_nnodes_is_the_workers_pod_count(
    jobset: dict[str, Any],
    k8s_docs: list[dict[str, Any]],
    real_secret_values: dict[tuple[str, str], str],
) -> None:
    workers = next(r for r in jobset["spec"]["replicatedJobs"] if r["name"] == "workers")
    pods = int(workers.get("replicas", 1)) * int(workers["template"]["spec"]["parallelism"])
    launches, _ = pod_launches(jobset, real_secret_values, k8s_docs)
    plans = [launch_problems(launch)[1] for launch in launches["workers"]]
    assert {o.host.nnodes for o in plans if o and o.host} == {pods}
    assert sorted(o.host.node_rank for o in plans if o and o.host) == list(range(pods))


def test_the_jobset_sets_only_variables_torchrelay_reads(jobset: dict[str, Any]) -> None:
    assert k8s_env_name_problems(jobset) == []


def test_secret_keys_exist_in_the_example_secret_which_holds_placeholders_only(
    jobset: dict[str, Any], secret_docs: list[dict[str, Any]]
) -> None:
    assert [d["kind"] for d in secret_docs] == ["Secret"]
    workloads = as_workloads(jobset)
    assert checks.k8s_secret_problems([*secret_docs, *workloads]) == []
    assert checks.k8s_credentials_mount_problems(workloads) == []


def test_the_mounted_credential_is_the_launchers(
    jobset: dict[str, Any], secret_docs: list[dict[str, Any]]
) -> None:
    """TORCHRELAY_NATS_CREDENTIALS is a file of the Secret holding `<launcher role>:...`."""
    values = {
        (s["metadata"]["name"], k): v for s in secret_docs for k, v in s["stringData"].items()
    }
    role = launcher_role()
    for wl in as_workloads(jobset):
        spec = wl["spec"]["template"]["spec"]
        c = spec["containers"][0]
        path = checks.container_env([], c)["TORCHRELAY_NATS_CREDENTIALS"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounted = [
            (volumes[m["name"]]["secret"]["secretName"], item["key"])
            for m in c["volumeMounts"]
            if "secret" in volumes[m["name"]]
            for item in volumes[m["name"]]["secret"].get("items") or []
            if f"{m['mountPath'].rstrip('/')}/{item['path']}" == path
        ]
        assert len(mounted) == 1, wl["metadata"]["name"]
        user, sep, _password = values[mounted[0]].partition(":")
        assert (user, sep) == (role, ":"), f"{mounted[0]} is not a credential of {role}"


def test_the_placeholder_claim_is_refused_by_the_launcher(
    jobset: dict[str, Any], secret_docs: list[dict[str, Any]], k8s_docs: list[dict[str, Any]]
) -> None:
    placeholders = {
        (s["metadata"]["name"], k): v for s in secret_docs for k, v in s["stringData"].items()
    }
    launches, _ = pod_launches(jobset, placeholders, k8s_docs)
    for launch in launches["workers"] + launches["spares"]:
        problems, _ = launch_problems(launch)
        assert _find(problems, "TORCHRELAY_JOB_CLAIM", "16 to 256"), launch.where


def test_the_training_manifests_are_not_part_of_the_control_plane(
    kustomization: dict[str, Any],
) -> None:
    listed = kustomization.get("resources") or []
    assert not [r for r in listed if "training" in r or "jobset" in r]
    assert checks.kustomization_problems(checks.K8S_DIR) == []


# ---------------------------------------------------------------------------- Slurm

SRUN_STUB = """#!{python}
# srun as this test needs it: each task of the step on its node, SLURM_* set as slurmd would.
import os, subprocess, sys
valued = {{"--nodes", "--ntasks", "--ntasks-per-node", "--nodelist", "--kill-on-bad-exit",
          "--wait"}}
flags = {{"--no-kill"}}
args, opts = sys.argv[1:], {{}}
while args and args[0].startswith("-"):
    name, eq, value = args.pop(0).partition("=")
    if (name in valued and eq) or (name in flags and not eq):
        opts[name] = value
    else:
        sys.exit(f"srun stand-in: unknown option {{name}}")
nodes = opts.get("--nodelist", "").split(",")
if not (opts.get("--nodes") == opts.get("--ntasks") == str(len(nodes))) or "" in nodes:
    sys.exit(f"srun stand-in: --nodes/--ntasks/--nodelist disagree: {{opts}}")
if opts.get("--ntasks-per-node") != "1" or "--no-kill" not in opts:
    sys.exit(f"srun stand-in: not one task per node with --no-kill: {{opts}}")
procs = [
    subprocess.Popen(args, env=dict(os.environ, SLURM_PROCID=str(i), SLURM_NODEID=str(i),
                     SLURM_LOCALID="0", SLURMD_NODENAME=node, SLURM_STEP_NUM_NODES=str(len(nodes))))
    for i, node in enumerate(nodes)
]
sys.exit(max(p.wait() for p in procs))
"""
SCONTROL_STUB = """#!{python}
import sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\\n".join(sys.argv[3].split(",")))
"""
TORCHRELAY_STUB = """#!{python}
import json, os, sys
name = f"{{os.environ['SLURMD_NODENAME']}}-{{os.getpid()}}.json"
path = os.path.join(os.environ["STUB_RECORDS"], name)
with open(path, "w") as out:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, out)
"""
ALLOCATION = [f"gpu-{i:02d}" for i in range(1, 6)]
SLURM_CLUSTER = "hpc"
SUBMITTER_ADDRESS = "10.99.0.1"


@dataclass
class SlurmRun:
    """What a run of the batch script started: its exit status and the launchers per kind."""

    returncode: int
    output: str
    workers: list[Launch]
    spares: list[Launch]


def run_sbatch(script: Path, tmp: Path, extra_env: Mapping[str, str] | None = None) -> SlurmRun:
    """Run the batch script under bash as Slurm would on the allocation's first node, with
    stand-ins for srun, scontrol and torchrelay; each node's launcher is recorded."""
    stubs, records = tmp / "bin", tmp / "records"
    stubs.mkdir()
    records.mkdir()
    for name, text in (
        ("srun", SRUN_STUB),
        ("scontrol", SCONTROL_STUB),
        ("torchrelay", TORCHRELAY_STUB),
    ):
        (stubs / name).write_text(text.format(python=sys.executable))
        (stubs / name).chmod(0o755)
    cred = tmp / "launcher.cred"
    cred.write_text("launcher:not-a-real-password\n")
    cred.chmod(0o600)
    env = {
        "PATH": f"{stubs}:/usr/bin:/bin",
        "HOME": str(tmp),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": ",".join(ALLOCATION),
        "SLURM_GPUS_PER_NODE": "h100:8",
        "NATS_URL": "nats://10.1.2.3:4222",
        "TORCHRELAY_NATS_CREDENTIALS": str(cred),
        "TORCHRELAY_CLUSTER": SLURM_CLUSTER,
        # The submitting shell's: must not name one host for every node.
        "TORCHRELAY_ADVERTISE_HOST": SUBMITTER_ADDRESS,
        "STUB_RECORDS": str(records),
        **(extra_env or {}),
    }
    done = subprocess.run(
        ["bash", str(script), "--steps", "5"],
        env=env,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    workers, spares = [], []
    for path in sorted(records.glob("*.json")):
        record = json.loads(path.read_text())
        node = record["env"]["SLURMD_NODENAME"]
        launch = Launch(
            where=f"slurm node {node}",
            argv=["torchrelay", *record["argv"]],
            env=record["env"],
            node=node,  # the Slurm node name: the agent runs with --node <it> (the script's header)
            cluster=SLURM_CLUSTER,
            gpus=int(env["SLURM_GPUS_PER_NODE"].rsplit(":", 1)[-1]),
        )
        (spares if "--spare" in record["argv"] else workers).append(launch)
    return SlurmRun(done.returncode, done.stdout + done.stderr, workers, spares)


def sbatch_problems(script: Path, tmp: Path) -> list[str]:
    """bash -n, then a run: it exits 0, starts one launcher on every node of the allocation
    (the spare nodes' with --spare), each parsed and planned by torchrelay as one job."""
    syntax = subprocess.run(
        ["bash", "-n", str(script)], capture_output=True, text=True, timeout=30, check=False
    )
    if syntax.returncode != 0:
        return [f"{script.name}: bash -n: {syntax.stderr.strip()}"]
    run = run_sbatch(script, tmp)
    problems = []
    if run.returncode != 0:
        problems.append(f"{script.name} exited {run.returncode}: {run.output.strip()[-500:]}")
    started = sorted(launch.node for launch in run.workers + run.spares)
    if started != sorted(ALLOCATION):
        problems.append(f"launchers started on {started}, not once on each of {ALLOCATION}")
    problems += job_problems(run.workers, run.spares)
    for launch in run.workers + run.spares:
        if launch.env.get("TORCHRELAY_ADVERTISE_HOST") == SUBMITTER_ADDRESS:
            problems.append(f"{launch.where}: advertises the submitting host's address")
    text = script.read_text()
    read = env_read_by_torchrelay()
    for name in sorted(set(re.findall(r"\b(?:TORCHRELAY|NATS)_[A-Z0-9_]+\b", text))):
        if name not in read:
            problems.append(f"{script.name}: {name} is read by no torchrelay code")
    return problems


@pytest.fixture(scope="module")
def sbatch_run(tmp_path_factory: pytest.TempPathFactory) -> SlurmRun:
    return run_sbatch(SBATCH_FILE, tmp_path_factory.mktemp("sbatch"))


def test_the_batch_script_is_bash_that_parses() -> None:
    result = subprocess.run(
        ["bash", "-n", str(SBATCH_FILE)], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, result.stderr
    assert SBATCH_FILE.read_text().startswith("#!/bin/bash\n")


def test_the_batch_script_starts_one_launcher_per_node_and_spares_on_their_own(
    sbatch_run: SlurmRun,
) -> None:
    assert sbatch_run.returncode == 0, sbatch_run.output
    spare_nodes = ALLOCATION[-1:]  # SPARE_NODES defaults to 1: the allocation's last node
    assert sorted(launch.node for launch in sbatch_run.spares) == spare_nodes
    assert sorted(launch.node for launch in sbatch_run.workers) == ALLOCATION[:-1]
    assert job_problems(sbatch_run.workers, sbatch_run.spares) == []
    plans = [launch_problems(launch)[1] for launch in sbatch_run.workers]
    assert {o.host.nnodes for o in plans if o and o.host} == {len(ALLOCATION) - 1}
    # One claim made by the script for the whole job, and the training arguments passed on.
    claims = {
        launch.env["TORCHRELAY_JOB_CLAIM"] for launch in sbatch_run.workers + sbatch_run.spares
    }
    assert len(claims) == 1
    assert all(o and o.script_args == ["--steps", "5"] for o in plans)


def test_the_batch_script_checks_pass(tmp_path: Path) -> None:
    assert sbatch_problems(SBATCH_FILE, tmp_path) == []


def test_the_launcher_reads_the_variables_the_files_set(
    jobset: dict[str, Any], sbatch_run: SlurmRun
) -> None:
    """Each of LAUNCHER_ENV is read by the launcher's own code (parsed now), set in every
    launcher container, and set by the batch script for every node but the advertised
    address, which each node's launcher finds itself."""
    read = env_read_in(LAUNCHER_SOURCES)
    assert set(LAUNCHER_ENV) <= read, sorted(set(LAUNCHER_ENV) - read)
    for wl in as_workloads(jobset):
        names = {e["name"] for e in wl["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert set(LAUNCHER_ENV) <= names, (wl["metadata"]["name"], set(LAUNCHER_ENV) - names)
    for launch in sbatch_run.workers + sbatch_run.spares:
        assert set(LAUNCHER_ENV) - set(launch.env) == {"TORCHRELAY_ADVERTISE_HOST"}, launch.where


# ------------------------------------------------------------- the checks can fail


def _rjob(jobset: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(r for r in jobset["spec"]["replicatedJobs"] if r["name"] == name)
    return found


def _pod(jobset: dict[str, Any], rjob: str) -> dict[str, Any]:
    pod: dict[str, Any] = _rjob(jobset, rjob)["template"]["spec"]["template"]["spec"]
    return pod


def _launcher(jobset: dict[str, Any], rjob: str) -> dict[str, Any]:
    container: dict[str, Any] = _pod(jobset, rjob)["containers"][0]
    return container


def _env_item(jobset: dict[str, Any], rjob: str, name: str) -> dict[str, Any]:
    item: dict[str, Any] = next(e for e in _launcher(jobset, rjob)["env"] if e["name"] == name)
    return item


def _wrong_nnodes(j: dict[str, Any]) -> None:
    command = _launcher(j, "workers")["command"]
    command[command.index("--nnodes") + 1] = "3"


def _no_spare_flag(j: dict[str, Any]) -> None:
    _launcher(j, "spares")["command"].remove("--spare")


def _flag_typo(j: dict[str, Any]) -> None:
    command = _launcher(j, "workers")["command"]
    command[command.index("--node-rank")] = "--node_rank"


def _other_tenant_for_spares(j: dict[str, Any]) -> None:
    command = _launcher(j, "spares")["command"]
    command[command.index("--tenant") + 1] = "other"


def _claim_variable_typo(j: dict[str, Any]) -> None:
    _env_item(j, "workers", "TORCHRELAY_JOB_CLAIM")["name"] = "TORCHRELAY_JOB_CLAIMS"


def _secret_key_typo(j: dict[str, Any]) -> None:
    ref = _env_item(j, "spares", "TORCHRELAY_JOB_CLAIM")["valueFrom"]["secretKeyRef"]
    ref["key"] = "job_claim"


def _node_name_from_the_pod(j: dict[str, Any]) -> None:
    _env_item(j, "workers", "NODE_NAME")["valueFrom"]["fieldRef"]["fieldPath"] = "metadata.name"


def _other_cluster(j: dict[str, Any]) -> None:
    _env_item(j, "workers", "TORCHRELAY_CLUSTER")["value"] = "local"


def _advertise_the_node(j: dict[str, Any]) -> None:
    item = _env_item(j, "spares", "TORCHRELAY_ADVERTISE_HOST")
    item["valueFrom"]["fieldRef"]["fieldPath"] = "status.hostIP"


def _half_the_gpus(j: dict[str, Any]) -> None:
    _launcher(j, "workers")["resources"]["limits"][GPU_RESOURCE] = 4


def _two_worker_jobs(j: dict[str, Any]) -> None:
    _rjob(j, "workers")["replicas"] = 2


def _hosts_one_after_another(j: dict[str, Any]) -> None:
    _rjob(j, "workers")["template"]["spec"]["parallelism"] = 2


def _jobset_default_restart_policy(j: dict[str, Any]) -> None:
    del _pod(j, "workers")["restartPolicy"]


def _credentials_mounted_elsewhere(j: dict[str, Any]) -> None:
    _launcher(j, "workers")["volumeMounts"][0]["mountPath"] = "/etc/nats"


JOBSET_MISTAKES: dict[str, tuple[Callable[[dict[str, Any]], None], tuple[str, ...]]] = {
    "nnodes": (_wrong_nnodes, ("--nnodes 3", "4 worker hosts")),
    "no --spare": (_no_spare_flag, ("spares pod", "--nnodes must be given")),
    "flag typo": (_flag_typo, ("parser rejects", "--node_rank")),
    "spare tenant": (_other_tenant_for_spares, ("one tenant",)),
    "claim variable": (_claim_variable_typo, ("TORCHRELAY_JOB_CLAIMS", "read by no torchrelay")),
    "secret key": (_secret_key_typo, ("job_claim", "does not exist")),
    "node name": (_node_name_from_the_pod, ("detector node agent reports",)),
    "cluster": (_other_cluster, ("TORCHRELAY_CLUSTER 'local'", "'prod'")),
    "advertise": (_advertise_the_node, ("advertises",)),
    "gpus": (_half_the_gpus, ("on 4 GPU(s)",)),
    "replicas": (_two_worker_jobs, ("node ranks",)),
    "parallelism": (_hosts_one_after_another, ("one after another",)),
    "restart policy": (_jobset_default_restart_policy, ("OnFailure",)),
    "mount": (_credentials_mounted_elsewhere, ("TORCHRELAY_NATS_CREDENTIALS",)),
}


@pytest.mark.parametrize("mistake", JOBSET_MISTAKES)
def test_the_jobset_checks_catch_mistakes(
    jobset: dict[str, Any],
    secret_docs: list[dict[str, Any]],
    real_secret_values: dict[tuple[str, str], str],
    k8s_docs: list[dict[str, Any]],
    mistake: str,
) -> None:
    assert jobset_problems(jobset, secret_docs, real_secret_values, k8s_docs) == []
    mutate, fragments = JOBSET_MISTAKES[mistake]
    broken = copy.deepcopy(jobset)
    mutate(broken)
    problems = jobset_problems(broken, secret_docs, real_secret_values, k8s_docs)
    assert _find(problems, *fragments), problems


# (text in the batch script, its replacement, what the checks must say)
SBATCH_MISTAKES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "no --spare": ("run --spare --job-id", "run --job-id", ("--nnodes must be given",)),
    "nnodes": ('--nnodes "$1"', '--nnodes "$2"', ("--nnodes 8", "4 worker hosts")),
    "claim not exported": ("export TORCHRELAY_JOB_CLAIM\n", "\n", ("no TORCHRELAY_JOB_CLAIM",)),
    "node name": ('"$SLURMD_NODENAME"', '"$HOSTNAME"', ("detector node agent reports",)),
    "spares on a worker": (
        'spares=$(IFS=,; echo "${nodes[*]:nnodes}")',
        "spares=${nodes[0]}",
        ("two launchers on one host",),
    ),
    "variable typo": (
        "export TORCHRELAY_CLUSTER=",
        "export TORCHRELAY_CLUSTR=",
        (
            "TORCHRELAY_CLUSTR",
            "read by no torchrelay code",
        ),
    ),
    "syntax": ("\nfi\nworkers=", "\nworkers=", ("bash -n",)),
}


@pytest.mark.parametrize("mistake", SBATCH_MISTAKES)
def test_the_batch_script_checks_catch_mistakes(tmp_path: Path, mistake: str) -> None:
    old, new, fragments = SBATCH_MISTAKES[mistake]
    text = SBATCH_FILE.read_text()
    assert old in text
    broken = tmp_path / "torchrelay.sbatch"
    broken.write_text(text.replace(old, new, 1))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    problems = sbatch_problems(broken, run_dir)
    assert _find(problems, *fragments), problems
