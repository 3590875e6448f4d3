"""``torchrelay run``'s arguments: checked, turned into Options, and run."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from torchrelay.contract import JobPolicy
from torchrelay.launcher._launcher import Launcher
from torchrelay.launcher._setup import (
    EXIT_USAGE,
    LauncherError,
    Options,
    resolve_credentials,
    resolve_nats_url,
    run_as_ids,
)

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]{1,100}$")


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
    if args.nproc < 1:
        raise LauncherError("--nproc must be at least 1")
    if args.spares < 0 or args.nodes < 1:
        raise LauncherError("--spares must be >= 0 and --nodes >= 1")
    verify_every = getattr(args, "verify_every", None)
    if verify_every is not None and verify_every < 0:
        raise LauncherError("--verify-every must be >= 0 (steps between checks; 0: never)")
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
        nproc=args.nproc,
        spares=args.spares,
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
        run_dir=(
            (home / "runs" / job_id).resolve()
            if run_as is None
            else Path(tempfile.gettempdir()) / "torchrelay-runs" / job_id
        ),
        run_as=run_as,
        python=python,
        module=module,
        credentials=resolve_credentials("launcher"),
        node_agents=not getattr(args, "no_node_agents", False),
        extra_env={} if verify_every is None else {"TORCHRELAY_VERIFY_EVERY": str(verify_every)},
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
    print(
        f"torchrelay run: job {opts.job_id}: {opts.nproc} workers, {opts.spares} spares "
        f"on {opts.nodes} node(s); run dir {opts.run_dir}",
        file=sys.stderr,
        flush=True,
    )
    return asyncio.run(Launcher(opts).run())
