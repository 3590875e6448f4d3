"""GPU telemetry backends: NVML, AMD SMI and a simulator, behind one interface.

``load_backend("nvml", cluster, node)`` returns a :class:`TelemetryBackend` or raises
:class:`BackendUnavailable` naming the backend and why it could not load;
``load_backends("auto", ...)`` loads every backend that works and reports the others.
"""

from __future__ import annotations

from pathlib import Path

from torchrelay.telemetry.base import BackendUnavailable, TelemetryBackend
from torchrelay.telemetry.sim import ChaosRequest, Scenario, SimBackend

BACKENDS = ("nvml", "amdsmi", "sim")


def load_backend(
    name: str, cluster: str, node: str, *, scenario: str | Path | None = None, gpus: int = 8
) -> TelemetryBackend:
    """Load one telemetry backend by name.

    Args:
        name: ``nvml``, ``amdsmi`` or ``sim``.
        cluster: cluster name stamped on samples.
        node: this node's name.
        scenario: for ``sim``, a scenario file (YAML or JSON).
        gpus: for ``sim`` without a scenario, how many GPUs to simulate.

    Raises:
        BackendUnavailable: the backend's library or driver is missing (the message says
            which and what to do), or ``name`` is not a backend.
    """
    if name == "nvml":
        from torchrelay.telemetry.nvml import NvmlBackend

        return NvmlBackend(cluster, node)
    if name == "amdsmi":
        from torchrelay.telemetry.amd import AmdSmiBackend

        return AmdSmiBackend(cluster, node)
    if name == "sim":
        try:
            loaded = Scenario.load(scenario) if scenario is not None else None
        except (OSError, ValueError) as exc:
            raise BackendUnavailable("sim", f"scenario {scenario}: {exc}") from exc
        return SimBackend(cluster, node, gpus=gpus, scenario=loaded)
    raise BackendUnavailable(name, f"no such backend; choose one of {', '.join(BACKENDS)}")


def load_backends(
    spec: str, cluster: str, node: str, *, scenario: str | Path | None = None, gpus: int = 8
) -> tuple[list[TelemetryBackend], list[BackendUnavailable]]:
    """Load the backends of ``spec`` (``auto``, one name, or a comma-separated list).

    ``auto`` tries NVML and AMD SMI (not the simulator: a real node must not report made-up
    telemetry). Returns the loaded backends and the failures, each naming its backend.
    """
    names = (
        ["nvml", "amdsmi"] if spec == "auto" else [s.strip() for s in spec.split(",") if s.strip()]
    )
    loaded: list[TelemetryBackend] = []
    failed: list[BackendUnavailable] = []
    for name in names:
        try:
            loaded.append(load_backend(name, cluster, node, scenario=scenario, gpus=gpus))
        except BackendUnavailable as exc:
            failed.append(exc)
    return loaded, failed


__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "ChaosRequest",
    "Scenario",
    "SimBackend",
    "TelemetryBackend",
    "load_backend",
    "load_backends",
]
