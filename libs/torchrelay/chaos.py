"""``torchrelay chaos``: inject a fault into a running job or a simulated node.

``kill`` and ``hang`` act on the process that holds a rank: the job's launcher is asked over
NATS (``Subjects.launcher(job, "pid")``) which member holds the rank in the current
generation and what its pid is, and that process gets SIGKILL or SIGSTOP. The signal is
sent from here, so run the command on the machine of the rank's host: a rank on another
machine (the launcher's boot id differs) is refused, naming its host.

Every other fault kind (``xid``, ``ecc``, ``thermal``, ``remap``, ``nvlink``, ``slow``) is
injected through the detector's simulator backend: a request on
``Subjects.chaos(cluster, node)`` answered by that node's detector agent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from typing import Any

from torchrelay.bus import Bus, BusError, NoResponder, RpcFailed
from torchrelay.contract import Subjects
from torchrelay.launcher import LauncherError, resolve_credentials, resolve_nats_url
from torchrelay.runtime import machine_id

PROCESS_FAULTS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}
EXIT_FAILED = 1
EXIT_USAGE = 2


def node_request(args: argparse.Namespace) -> dict[str, Any]:
    """The simulator request of a node fault: ``{"fault", "gpu", "code", "factor", "duration"}``."""
    return {
        "fault": args.fault,
        "gpu": args.gpu,
        "code": args.code,
        "factor": args.factor,
        "duration": args.duration,
    }


def elsewhere(found: dict[str, Any]) -> str | None:
    """Why the process a launcher reported cannot be signalled from here (its pid is another
    machine's: a signal here would hit a stranger), or None."""
    if found.get("machine") in (None, machine_id()):
        return None
    return (
        f"{found.get('member_id')} runs on host {found.get('node')}, another machine: run "
        "this command there"
    )


async def _lookup_pid(bus: Bus, job_id: str, rank: int) -> dict[str, Any]:
    result = await bus.request(Subjects.launcher(job_id, "pid"), {"rank": rank}, timeout=5.0)
    if not isinstance(result, dict) or not isinstance(result.get("pid"), int):
        raise BusError(f"the launcher of {job_id} answered without a pid: {result!r}")
    return result


async def _chaos(args: argparse.Namespace, url: str) -> int:
    bus = await Bus.connect(url, "chaos", timeout=5.0, credentials=resolve_credentials("operator"))
    try:
        if args.fault in PROCESS_FAULTS:
            try:
                found = await _lookup_pid(bus, args.job, args.rank)
            except NoResponder:
                print(
                    f"torchrelay chaos: no launcher answers for job {args.job}: is "
                    "`torchrelay run` running it on this machine?",
                    file=sys.stderr,
                )
                return EXIT_FAILED
            sig = PROCESS_FAULTS[args.fault]
            refusal = elsewhere(found)
            if refusal is not None:
                print(f"torchrelay chaos: {refusal}", file=sys.stderr)
                return EXIT_FAILED
            try:
                os.kill(found["pid"], sig)
            except ProcessLookupError:
                print(
                    f"torchrelay chaos: process {found['pid']} of {found['member_id']} is "
                    "gone already",
                    file=sys.stderr,
                )
                return EXIT_FAILED
            except PermissionError:
                print(
                    f"torchrelay chaos: not allowed to signal pid {found['pid']}: run as the "
                    "user that started the job",
                    file=sys.stderr,
                )
                return EXIT_FAILED
            print(
                json.dumps(
                    {
                        "fault": args.fault,
                        "job_id": args.job,
                        "rank": args.rank,
                        "member_id": found["member_id"],
                        "pid": found["pid"],
                        "signal": sig.name,
                        "generation": found.get("generation"),
                    }
                )
            )
            return 0
        cluster = os.environ.get("TORCHRELAY_CLUSTER", "local")
        subject = Subjects.chaos(cluster, args.node)
        try:
            reply = await bus.request(subject, node_request(args), timeout=5.0)
        except NoResponder:
            print(
                f"torchrelay chaos: no detector node agent answers for {cluster}/{args.node}"
                f" ({subject}): is the job's launcher or the detector agent running?",
                file=sys.stderr,
            )
            return EXIT_FAILED
        print(json.dumps(reply, default=str))
        return 0
    except RpcFailed as exc:
        print(f"torchrelay chaos: refused: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        await bus.close()


def cmd_chaos(args: argparse.Namespace) -> int:
    """``torchrelay chaos FAULT ...``: kill/hang a rank's process, or inject a node fault."""
    if args.fault in PROCESS_FAULTS:
        if not args.job or args.rank is None:
            print(f"torchrelay chaos {args.fault}: needs --job ID --rank R", file=sys.stderr)
            return EXIT_USAGE
    elif not args.node:
        print(f"torchrelay chaos {args.fault}: needs --node N (and --gpu G)", file=sys.stderr)
        return EXIT_USAGE
    try:
        url = resolve_nats_url()
    except LauncherError as exc:
        print(f"torchrelay chaos: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return asyncio.run(_chaos(args, url))
    except BusError as exc:
        print(f"torchrelay chaos: {exc}", file=sys.stderr)
        return EXIT_FAILED
