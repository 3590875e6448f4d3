"""The interface every GPU telemetry backend implements (NVML, AMD SMI, the simulator).

A backend reads every GPU of its node into :class:`~torchrelay.contract.TelemetrySample`
objects (``read``), and delivers critical events (XIDs, double-bit ECC, a GPU falling off
the bus) from a blocking call that the node agent runs on its own thread (``wait_events``).
Fields a device does not support are left ``None``; one failing field never loses the others.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torchrelay.contract import TelemetrySample


class BackendUnavailable(RuntimeError):
    """A backend could not load; the message names the backend and why (no driver, no library).

    Attributes:
        backend: the backend's name (``nvml``, ``amdsmi``, ``sim``).
        reason: what went wrong and what to do about it.
    """

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(f"telemetry backend {backend!r} is unavailable: {reason}")
        self.backend = backend
        self.reason = reason


@runtime_checkable
class TelemetryBackend(Protocol):
    """What the node agent needs from a telemetry source."""

    name: str

    def gpu_count(self) -> int:
        """How many GPUs the backend sees now."""
        ...

    def read(self) -> list[TelemetrySample]:
        """One sample per GPU (a lost GPU yields a sample with ``gpu_lost=True``)."""
        ...

    def wait_events(self, timeout_s: float) -> list[TelemetrySample]:
        """Block up to ``timeout_s`` for critical events; return them as samples (may be empty).

        Called from a dedicated thread, never from the event loop.
        """
        ...

    def close(self) -> None:
        """Release the library (``nvmlShutdown``, ``amdsmi_shut_down``); idempotent."""
        ...


__all__ = ["BackendUnavailable", "TelemetryBackend"]
