"""``torchrelay run``'s arguments: checked, turned into Options, and run."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import re
import shutil
import socket
import sys
import tempfile
import uuid
from pathlib import Path

from torchrelay.contract import JobPolicy
from torchrelay.launcher._hosts import advertise_address, parse_gpus
from torchrelay.launcher._launcher import Launcher
from torchrelay.launcher._setup import (
    EXIT_USAGE,
    HostPlan,
    LauncherError,
    Options,
    resolve_credentials,
    resolve_nats_url,
    run_as_ids,
)

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]{1,100}$")
_NAME = re.compile(r"^[A-Za-z0-9_\-.:]{1,128}$")
ID_LIMIT = 128  # contract.Name/Token


def host_plan(args: argparse.Namespace, job_id: str) -> HostPlan | None:
    """This host's part of a job across hosts, or None for the one-host shortcut.

    Raises:
        LauncherError: the flags of the two modes are mixed, or one is out of range.
    """
    nnodes = getattr(args, "nnodes", None)
    per_node = getattr(args, "nproc_per_node", None)
    spare = bool(getattr(args, "spare", False))
    if nnodes is None and per_node is None and not spare:
        for flag in ("node_rank", "node_name", "gpus"):
            if getattr(args, flag, None) is not None:
                raise LauncherError(
                    f"--{flag.replace('_', '-')} belongs to a job across hosts: give "
                    "--nnodes and --nproc-per-node too"
                )
        return None
    if getattr(args, "nproc", None) is not None or getattr(args, "nodes", 1) != 1:
        raise LauncherError(
            "--nproc/--nodes are the one-host shortcut; across hosts give --nnodes and "
            "--nproc-per-node (and --spare on a spare host)"
        )
    if not getattr(args, "job_id", None):
        raise LauncherError("a job across hosts needs --job-id: the same on every host")
    if per_node is None or per_node < 1:
        raise LauncherError("--nproc-per-node must be given and at least 1")
    if spare and (nnodes is not None or getattr(args, "node_rank", None) is not None):
        raise LauncherError("a spare host (--spare) takes no --nnodes or --node-rank")
    if not spare and (nnodes is None or nnodes < 1):
        raise LauncherError("--nnodes must be given and at least 1")
    node_rank = getattr(args, "node_rank", None)
    if node_rank is not None and not 0 <= node_rank < (nnodes or 1):
        raise LauncherError(f"--node-rank {node_rank} must be in 0..{(nnodes or 1) - 1}")
    node = getattr(args, "node_name", None) or socket.gethostname()
    if not _NAME.match(node):
        raise LauncherError(f"--node-name {node!r}: use letters, digits, '_', '-', '.', ':'")
    local_spares = 0 if spare else max(0, int(getattr(args, "spares", 0) or 0))
    claim = os.environ.get("TORCHRELAY_JOB_CLAIM") or None
    if claim is not None and not 16 <= len(claim) <= 256:
        raise LauncherError("TORCHRELAY_JOB_CLAIM must be 16 to 256 characters")
    nats = resolve_nats_url()
    plan = HostPlan(
        node=node,
        nproc_per_node=per_node,
        gpus=parse_gpus(getattr(args, "gpus", None), per_node + local_spares),
        nnodes=nnodes or 1,
        node_rank=node_rank,
        spare_host=spare,
        simulate_gpus=bool(getattr(args, "simulate_gpus", False)),
        claim=claim,
        advertise_host=os.environ.get("TORCHRELAY_ADVERTISE_HOST") or advertise_address(nats),
    )
    # Ids built from both (``<job>-launcher-<host>``, ``<job>-<host>-s<n>``) are names of at
    # most 128 characters on the bus: refuse them here, not when the job registers.
    longest = f"{job_id}-launcher-{plan.token}"
    if len(longest) > ID_LIMIT:
        raise LauncherError(
            f"--job-id ({len(job_id)} characters) and this host's name ({len(plan.token)} "
            f"used) make ids of {len(longest)} characters, over {ID_LIMIT}: give a shorter "
            "--job-id or --node-name"
        )
    return plan


def checkpoint_env(args: argparse.Namespace, env: dict[str, str]) -> Path | None:
    """``--checkpoint-dir/--checkpoint-every(-s)/--checkpoint-keep`` into the children's
    environment (``TORCHRELAY_CHECKPOINT_*``); returns the folder (None: no checkpoints).

    Raises:
        LauncherError: a flag without the others it needs, or a bad number.
    """
    folder = getattr(args, "checkpoint_dir", None)
    every = getattr(args, "checkpoint_every", None)
    every_s = getattr(args, "checkpoint_every_s", None)
    keep = getattr(args, "checkpoint_keep", None)
    if folder is None:
        if every is not None or every_s is not None or keep is not None:
            raise LauncherError(
                "--checkpoint-every/--checkpoint-every-s/--checkpoint-keep need --checkpoint-dir"
            )
        return None
    if every is None and every_s is None:
        raise LauncherError(
            "--checkpoint-dir needs --checkpoint-every N (N >= 1 steps) or "
            "--checkpoint-every-s S (seconds)"
        )
    if every is not None and every < 1:
        raise LauncherError(f"--checkpoint-every {every}: give N >= 1 steps")
    if every_s is not None and not 0 < every_s < 1e9:
        raise LauncherError(f"--checkpoint-every-s {every_s}: give a number of seconds > 0")
    if keep is not None and keep < 1:
        raise LauncherError("--checkpoint-keep must be at least 1")
    path = Path(folder).resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LauncherError(f"--checkpoint-dir {folder}: {exc.strerror or exc}") from None
    env["TORCHRELAY_CHECKPOINT_DIR"] = str(path)
    if every is not None:
        env["TORCHRELAY_CHECKPOINT_EVERY"] = str(every)
    if every_s is not None:
        env["TORCHRELAY_CHECKPOINT_EVERY_S"] = repr(float(every_s))
    if keep is not None:
        env["TORCHRELAY_CHECKPOINT_KEEP"] = str(keep)
    return path


def options_from_args(args: argparse.Namespace) -> Options:
    """Validate ``torchrelay run`` arguments into :class:`Options`.

    Raises:
        LauncherError: an argument is invalid or no NATS server is configured.
    """
    job_id = args.job_id or f"job-{uuid.uuid4().hex[:8]}"
    if not _TOKEN.match(job_id):
        raise LauncherError(f"--job-id {job_id!r}: use letters, digits, '_' and '-' only")
    if not _TOKEN.match(args.tenant):
        raise LauncherError(f"--tenant {args.tenant!r}: use letters, digits, '_' and '-' only")
    host = host_plan(args, job_id)
    nproc, spares = args.nproc, args.spares
    if host is not None:
        nproc = 0 if host.spare_host else host.nproc_per_node
        spares = host.nproc_per_node if host.spare_host else args.spares
    elif nproc is None:
        raise LauncherError(
            "give --nproc N (one host) or --nnodes N --nproc-per-node P (one launcher per host)"
        )
    if host is None and nproc < 1:
        raise LauncherError("--nproc must be at least 1")
    if spares < 0 or args.nodes < 1:
        raise LauncherError("--spares must be >= 0 and --nodes >= 1")
    verify_every = getattr(args, "verify_every", None)
    if verify_every is not None and verify_every < 0:
        raise LauncherError("--verify-every must be >= 0 (steps between checks; 0: never)")
    extra_env = {} if verify_every is None else {"TORCHRELAY_VERIFY_EVERY": str(verify_every)}
    checkpoint_dir = checkpoint_env(args, extra_env)
    max_restarts = getattr(args, "max_restarts", 3)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise LauncherError("--max-restarts must be a whole number >= 0")
    module = bool(getattr(args, "module", False))
    script = Path(args.script)
    if module:
        try:
            found = importlib.util.find_spec(args.script)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise LauncherError(f"-m {args.script}: no such module on this Python's path")
    elif not script.is_file():
        raise LauncherError(f"training script {args.script} does not exist")
    python = getattr(args, "python", None) or sys.executable
    if shutil.which(python) is None:
        raise LauncherError(f"--python {python}: not an executable interpreter")
    run_as_user = getattr(args, "run_as", None)
    run_as = run_as_ids(run_as_user) if run_as_user else None
    if run_as is not None and not module:
        script = script.resolve()  # the training user may not share the launcher's cwd
    cluster = os.environ.get("TORCHRELAY_CLUSTER", "local")
    home = Path(os.environ.get("TORCHRELAY_HOME", ".torchrelay"))
    script_args = list(args.args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    return Options(
        nproc=nproc,
        spares=spares,
        job_id=job_id,
        tenant=args.tenant,
        nodes=args.nodes,
        policy=JobPolicy(args.policy),
        wait_timeout_s=float(getattr(args, "wait_timeout", 60.0)),
        allow_shrink=bool(getattr(args, "allow_shrink", False)),
        script=str(script),
        script_args=script_args,
        nats_url=resolve_nats_url(),
        cluster=cluster,
        # One folder per host: hosts may share a file system (or, in tests, a machine).
        run_dir=(
            (home / "runs" / job_id).resolve()
            if run_as is None
            else Path(tempfile.gettempdir()) / "torchrelay-runs" / job_id
        )
        / (host.token if host is not None else ""),
        run_as=run_as,
        python=python,
        module=module,
        credentials=resolve_credentials("launcher"),
        node_agents=not getattr(args, "no_node_agents", False),
        extra_env=extra_env,
        checkpoint_dir=checkpoint_dir,
        max_restarts=max_restarts,
        host=host,
        node_agent_credentials=os.environ.get("TORCHRELAY_NODE_AGENT_CREDENTIALS")
        or resolve_credentials(
            "node_agent",
            {k: v for k, v in os.environ.items() if k != "TORCHRELAY_NATS_CREDENTIALS"},
        ),
    )


def cmd_run(args: argparse.Namespace) -> int:
    """``torchrelay run``: run SCRIPT with ``--nproc`` workers and ``--spares`` hot spares."""
    try:
        opts = options_from_args(args)
    except LauncherError as exc:
        print(f"torchrelay run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    where = f"on {opts.nodes} node(s)" if opts.host is None else f"on host {opts.host.node}"
    print(
        f"torchrelay run: job {opts.job_id}: {opts.nproc} workers, {opts.spares} spares "
        f"{where}; run dir {opts.run_dir}",
        file=sys.stderr,
        flush=True,
    )
    return asyncio.run(Launcher(opts).run())
