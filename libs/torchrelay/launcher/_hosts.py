"""A launcher as one host of a job across hosts: its plan, its slots, its rendezvous, its
beats, and how it learns that the job ended elsewhere (torchrun's conventions)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from torchrelay.bus import Bus, BusError, NoResponder, RpcFailed
from torchrelay.contract import (
    Generation,
    Heartbeat,
    HostJoin,
    HostJoined,
    Subjects,
    make_event_id,
)
from torchrelay.launcher._setup import Child, HostPlan, HostRefused, LauncherError, Outcome

BEAT_INTERVAL_S = 0.5  # the detector's launcher timeout (2 s by default) is four beats
JOIN_RETRY_S = 40.0  # the scheduler may be (re)starting when the hosts come up
# The job's end, as the scheduler recorded it (JobFinished of any host's launcher).
ENDED_STATES = frozenset({"succeeded", "failed", "cancelled"})


def parse_gpus(text: str | None, needed: int) -> list[int]:
    """``--gpus 0,1,...``: the devices of this host's slots (default ``0 .. needed-1``).

    Raises:
        LauncherError: not a list of distinct device indexes, or fewer than ``needed``.
    """
    if text is None or not text.strip():
        return list(range(needed))
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise LauncherError(f"--gpus {text!r}: give device indexes, e.g. --gpus 0,1,2,3") from None
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise LauncherError(f"--gpus {text!r}: device indexes must be distinct and >= 0")
    if len(gpus) < needed:
        raise LauncherError(
            f"--gpus {text!r} names {len(gpus)} device(s); this host needs {needed} "
            "(its ranks, then its spares)"
        )
    return gpus[:needed]


def advertise_address(nats_url: str) -> str:
    """The address of this host on the way to the NATS server: where the other hosts'
    ranks reach this host's (its rendezvous store and its process-group sockets)."""
    first = nats_url.split(",")[0]
    parts = urlsplit(first if "://" in first else f"nats://{first}")
    host, port = parts.hostname or "127.0.0.1", parts.port or 4222
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # no packet is sent: this only picks the route
        return str(s.getsockname()[0])
    return "127.0.0.1"


def gpu_model(gpu: int, simulated: bool) -> str:
    """The model the GPU backend reports for device ``gpu`` (``cpu-sim``: simulated slots,
    ``cpu``: no GPU backend on this host)."""
    if simulated:
        return "cpu-sim"
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(gpu))
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return "cpu"
    text = name.decode() if isinstance(name, bytes) else str(name)
    return text[:64] or "cpu"


async def join_host(bus: Bus, job_id: str, tenant: str, plan: HostPlan) -> HostJoined:
    """Join the job's rendezvous; this host's node rank and the job's world size.

    Raises:
        HostRefused: the scheduler refused the host (late, twice, rank taken, shape, claim).
        LauncherError: the scheduler did not answer.
    """
    req = HostJoin(
        job_id=job_id,
        tenant=tenant,
        node=plan.node,
        nnodes=plan.nnodes,
        nproc_per_node=plan.nproc_per_node,
        node_rank=plan.node_rank,
        instance=plan.instance,
        claim=plan.claim,
    )
    deadline = asyncio.get_running_loop().time() + JOIN_RETRY_S
    while True:
        try:
            got = await bus.request(Subjects.rpc("scheduler", "join_host"), req, timeout=5.0)
            return HostJoined.model_validate(got)
        except RpcFailed as exc:
            raise HostRefused(f"host {plan.node} cannot join job {job_id}: {exc}") from None
        except (NoResponder, BusError) as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise LauncherError(
                    f"host {plan.node} cannot join job {job_id}: the scheduler did not "
                    f"answer ({exc}); is the control plane reachable?"
                ) from None
            await asyncio.sleep(1.0)


async def beat(bus: Bus, job_id: str, launcher_id: str, node: str, cluster: str) -> None:
    """Tell the detector this host is alive, every :data:`BEAT_INTERVAL_S`, until cancelled."""
    seq = 0
    while True:
        seq += 1
        hb = Heartbeat(
            event_id=make_event_id("launcher_beat", launcher_id, seq),
            source=launcher_id,
            job_id=job_id,
            member_id=launcher_id,
            generation=0,
            step=-1,
            kind="launcher",
            node=node,
            gpu=0,
            pid=0,
            cluster=cluster,
        )
        with contextlib.suppress(BusError, OSError):
            await bus.publish_core(Subjects.heartbeat(job_id), hb)
        await asyncio.sleep(BEAT_INTERVAL_S)


async def stopped(bus: Bus, job_id: str, launcher_id: str, node: str, cluster: str) -> None:
    """This host's launcher ends on purpose: its silence from now on is no host loss."""
    hb = Heartbeat(
        event_id=make_event_id("launcher_stopped", launcher_id),
        source=launcher_id,
        job_id=job_id,
        member_id=launcher_id,
        generation=0,
        step=-1,
        kind="launcher_stopped",
        node=node,
        gpu=0,
        pid=0,
        cluster=cluster,
    )
    with contextlib.suppress(BusError, OSError):
        await bus.publish_core(Subjects.heartbeat(job_id), hb)


async def job_end(bus: Bus, job_id: str) -> str | None:
    """The job's outcome if the control plane recorded its end (any host's launcher), else
    None (still running, or the scheduler did not answer)."""
    try:
        view = await bus.request(
            Subjects.rpc("scheduler", "job_get"), {"job_id": job_id}, timeout=2.0
        )
    except BusError:
        return None
    state = view.get("state") if isinstance(view, dict) else None
    return str(state) if state in ENDED_STATES else None


# A launcher's handler returns this for work of another host: no reply, that host answers.
NOT_MINE: Any = object()


def host_verdict(
    children: list[Child],
    current: Generation | None,
    ended: str | None,
    gave_up: str | None,
    lost_bound_s: float,
    run_dir: Path,
) -> tuple[Outcome, str] | None:
    """``(outcome, summary)`` once this host's part of a job across hosts is over, else None.

    A host sees only its own processes. Ranks finish only together (they agree on the last
    step), so one of its processes that finished means the job's last step committed: the
    host is done once none of its rank holders runs. A host with no rank left (its ranks
    moved away, or a spare host whose spares were not needed) waits for the job's end as
    the control plane recorded it (``ended``: the first host's JobFinished).
    """
    app = [c for c in children if c.outcome == "application_error"]
    if app:
        return "failed", (
            f"{app[0].member_id} raised in user code (application error); "
            f"see {run_dir / (app[0].member_id + '.exit.json')}"
        )
    if gave_up is not None:
        return "failed", gave_up
    holders = [
        c for c in children if current is not None and current.member_rank(c.member_id) is not None
    ]
    if ended is not None and ended != "succeeded":
        return (
            "cancelled" if ended == "cancelled" else "failed"
        ), f"the job {ended} on another host"
    if any(c.outcome == "finished" for c in children) or ended == "succeeded":
        if any(c.alive for c in holders):
            return None  # they are finishing the last step too
        gen = current.generation if current is not None else 0
        mine = sum(c.outcome == "finished" for c in children)
        return (
            "succeeded",
            f"the job finished; {mine} rank(s) of this host finished in generation {gen}",
        )
    now = time.monotonic()
    for c in holders:
        if c.outcome == "lost" and c.lost_at is not None and now - c.lost_at > lost_bound_s:
            return "failed", (
                f"{c.member_id} was lost and its rank was not replaced within {lost_bound_s:.0f}s"
            )
    return None
