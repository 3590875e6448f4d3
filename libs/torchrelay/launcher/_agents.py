"""The detector node agents a launcher runs beside simulated slots (``--simulate-gpus``, and
the one-host shortcut), so that ``torchrelay chaos xid|ecc|...`` reaches them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

from torchrelay.launcher._setup import Options
from torchrelay.runtime import services_path, with_services_path


async def start_node_agents(o: Options) -> list[asyncio.subprocess.Process]:
    """One detector node agent per simulated node, simulator backend (docs/interfaces.md).

    They make ``torchrelay chaos xid|ecc|...`` reach the job's slots. Skipped, with a
    note, where the detector service's code is not installed.
    """
    agents: list[asyncio.subprocess.Process] = []
    if not o.node_agents or (o.host is not None and not o.host.simulate_gpus):
        return agents  # a real host's node agent runs beside it (the detector's DaemonSet)
    if services_path() is None:
        print(
            "torchrelay run: note: the control plane (services.detector) is not installed; "
            "no simulated node agents (chaos xid/ecc/... will find no node)",
            file=sys.stderr,
        )
        return agents
    total = o.nproc + o.spares
    gpus = max(8, -(-total // o.nodes) + 2)  # room for cold spares spawned later
    nodes = [f"{o.cluster}-{k}" for k in range(o.nodes)]
    if o.host is not None:
        nodes, gpus = [o.host.node], max(8, max(o.host.gpus, default=0) + 3)
    env = with_services_path(
        {**os.environ, "NATS_URL": o.nats_url, "TORCHRELAY_CLUSTER": o.cluster}
    )
    if o.node_agent_credentials:
        env["TORCHRELAY_NATS_CREDENTIALS"] = o.node_agent_credentials
    else:
        env.pop("TORCHRELAY_NATS_CREDENTIALS", None)
    for node in nodes:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.detector",
            "agent",
            "--node",
            node,
            "--cluster",
            o.cluster,
            "--backend",
            "sim",
            "--gpus",
            str(gpus),
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        agents.append(proc)
    return agents


async def stop_node_agents(agents: list[asyncio.subprocess.Process]) -> None:
    """Stop the node agents :func:`start_node_agents` started."""
    for proc in agents:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
    for proc in agents:
        try:
            await asyncio.wait_for(proc.wait(), 5.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
