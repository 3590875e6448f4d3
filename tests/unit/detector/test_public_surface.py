"""The public names of the telemetry package (other engineers' code imports them)."""

from __future__ import annotations

import torchrelay.telemetry as telemetry


def test_telemetry_public_surface_is_pinned() -> None:
    assert sorted(telemetry.__all__) == [
        "BACKENDS",
        "BackendUnavailable",
        "ChaosRequest",
        "Scenario",
        "SimBackend",
        "TelemetryBackend",
        "load_backend",
        "load_backends",
    ]
    assert telemetry.BACKENDS == ("nvml", "amdsmi", "sim")


def test_every_backend_satisfies_the_protocol() -> None:
    from torchrelay.telemetry.amd import AmdSmiBackend
    from torchrelay.telemetry.nvml import NvmlBackend

    for cls in (NvmlBackend, AmdSmiBackend, telemetry.SimBackend):
        for attr in ("name", "gpu_count", "read", "wait_events", "close"):
            assert hasattr(cls, attr), f"{cls.__name__} lacks {attr}"
    assert isinstance(telemetry.SimBackend("c", "n", gpus=1), telemetry.TelemetryBackend)
