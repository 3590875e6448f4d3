"""The AMD SMI backend (against a stand-in ``amdsmi``: no AMD GPU or library here), the
simulator backend and its scenario format, and ``load_backend``'s reports."""

from __future__ import annotations

import enum
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from services.detector.rules import DetectorConfig, GpuWindows, evaluate_sample
from torchrelay.contract import FaultKind
from torchrelay.telemetry import (
    BackendUnavailable,
    ChaosRequest,
    Scenario,
    SimBackend,
    load_backend,
    load_backends,
)
from torchrelay.telemetry.amd import AmdSmiBackend

# --------------------------------------------------------------------------- AMD SMI stand-in


class AmdSmiException(Exception):
    pass


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int) -> None:
        super().__init__(f"AMD SMI error {err_code}")
        self.err_code = err_code


NOT_SUPPORTED = 2


def make_amdsmi(
    handles: int = 2, fail: dict[str, int] | None = None, events: list[dict[str, Any]] | None = None
) -> types.ModuleType:
    m = types.ModuleType("amdsmi")
    fail = fail or {}
    m.AmdSmiException = AmdSmiException  # type: ignore[attr-defined]
    m.AmdSmiLibraryException = AmdSmiLibraryException  # type: ignore[attr-defined]
    m.amdsmi_wrapper = types.SimpleNamespace(
        AMDSMI_STATUS_NOT_SUPPORTED=NOT_SUPPORTED,  # type: ignore[attr-defined]
        AMDSMI_STATUS_NOT_YET_IMPLEMENTED=3,
    )
    m.AmdSmiGpuBlock = enum.Enum("AmdSmiGpuBlock", "UMC SDMA GFX")  # type: ignore[attr-defined]
    m.AmdSmiTemperatureType = enum.Enum("AmdSmiTemperatureType", "EDGE HOTSPOT VRAM")  # type: ignore[attr-defined]
    m.AmdSmiTemperatureMetric = enum.Enum(
        "AmdSmiTemperatureMetric",  # type: ignore[attr-defined]
        "CURRENT CRITICAL EMERGENCY",
    )
    m.AmdSmiEvtNotificationType = enum.Enum(
        "AmdSmiEvtNotificationType",  # type: ignore[attr-defined]
        "VMFAULT THERMAL_THROTTLE GPU_PRE_RESET GPU_POST_RESET RING_HANG",
    )
    pending = list(events or [])

    def call(name: str, value: Any) -> Any:
        if name in fail:
            raise AmdSmiLibraryException(fail[name])
        return value

    temps = {
        ("HOTSPOT", "CURRENT"): 71,
        ("HOTSPOT", "CRITICAL"): 100,
        ("HOTSPOT", "EMERGENCY"): 105,
        ("VRAM", "CURRENT"): 66,
        ("EDGE", "CURRENT"): 55,
    }
    m.amdsmi_init = lambda *a: None  # type: ignore[attr-defined]
    m.amdsmi_shut_down = lambda: None  # type: ignore[attr-defined]
    m.amdsmi_get_processor_handles = lambda: [f"h{i}" for i in range(handles)]  # type: ignore[attr-defined]
    m.amdsmi_get_gpu_asic_info = lambda h: {"market_name": "AMD Instinct MI300X"}  # type: ignore[attr-defined]
    m.amdsmi_get_gpu_total_ecc_count = lambda h: call(  # type: ignore[attr-defined]
        "total", {"correctable_count": 5, "uncorrectable_count": 0, "deferred_count": 0}
    )
    m.amdsmi_get_gpu_ecc_count = lambda h, b: call(  # type: ignore[attr-defined]
        "block", {"correctable_count": 5 if b.name == "UMC" else 0, "uncorrectable_count": 0}
    )
    m.amdsmi_get_gpu_bad_page_info = lambda h: call("pages", [])  # type: ignore[attr-defined]
    m.amdsmi_get_temp_metric = lambda h, s, k: call(  # type: ignore[attr-defined]
        "temp", temps.get((s.name, k.name), "N/A")
    )
    m.amdsmi_get_power_info = lambda h: call(  # type: ignore[attr-defined]
        "power",
        {"current_socket_power": 550, "average_socket_power": 540, "power_limit": 750_000_000},
    )
    m.amdsmi_get_violation_status = lambda h: call(  # type: ignore[attr-defined]
        "violation",
        {
            "active_prochot_thrm": False,
            "active_ppt_pwr": False,
            "active_socket_thrm": False,
            "active_vr_thrm": False,
            "active_hbm_thrm": False,
            "acc_socket_thrm": 7,
            "per_socket_thrm": "N/A",
        },
    )
    m.amdsmi_get_gpu_pci_replay_counter = lambda h: call("replay", 2)  # type: ignore[attr-defined]

    class AmdSmiEventReader:
        def __init__(self, handle: str, types_: list[Any]) -> None:
            self.handle = handle

        def read(self, timeout_ms: int, num_elem: int = 10) -> list[dict[str, Any]]:
            out = [e for e in pending if e["processor_handle"] == self.handle]
            for e in out:
                pending.remove(e)
            return out

        def stop(self) -> None:
            return None

    m.AmdSmiEventReader = AmdSmiEventReader  # type: ignore[attr-defined]
    return m


def test_amd_backend_reads_its_signals() -> None:
    s = AmdSmiBackend("c", "n0", module=make_amdsmi()).read()[1]
    assert (s.backend, s.gpu, s.gpu_model) == ("amdsmi", 1, "AMD Instinct MI300X")
    assert (s.ecc_volatile_corrected, s.ecc_volatile_uncorrected) == (5, 0)
    assert s.extra["ecc_corr_umc"] == 5
    assert (s.temperature_c, s.temp_slowdown_c, s.temp_shutdown_c) == (71, 100, 105)
    assert s.memory_temperature_c == 66
    assert s.extra["temp_edge_c"] == 55
    assert (s.power_w, s.power_limit_w) == (550, 750)
    assert (s.hw_slowdown, s.hw_thermal_slowdown) == (False, False)
    assert s.extra["violation_acc_socket_thrm"] == 7
    assert "violation_per_socket_thrm" not in s.extra
    assert s.pcie_replay_count == 2
    assert s.retired_pages == 0


def test_amd_unsupported_or_failing_fields_are_lost_one_by_one() -> None:
    b = AmdSmiBackend("c", "n0", module=make_amdsmi(fail={"temp": NOT_SUPPORTED, "power": 8}))
    s = b.read()[0]
    assert s.temperature_c is None
    assert s.power_w is None
    assert s.pcie_replay_count == 2
    assert s.ecc_volatile_corrected == 5
    assert s.extra["read_errors"] == 1  # power failed; temperature is merely unsupported


def test_amd_events_become_critical_samples() -> None:
    mod = make_amdsmi(
        events=[
            {"processor_handle": "h1", "event": "GPU_PRE_RESET", "message": "reset"},
            {"processor_handle": "h0", "event": "VMFAULT", "message": "page fault"},
        ]
    )
    b = AmdSmiBackend("c", "n0", module=mod)
    got = {(e.gpu, e.xid) for e in b.wait_events(0.05)}
    assert got == {(1, 119), (0, 31)}
    cfg = DetectorConfig()
    kinds = {
        f.kind
        for e in [*got]
        for f in evaluate_sample(GpuWindows(cfg), b.read()[0].model_copy(update={"xid": e[1]}), cfg)
    }
    assert kinds == {FaultKind.FIRMWARE_HANG, FaultKind.APPLICATION_ERROR}


def test_amd_without_the_library_says_which_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import fails as if not installed
    with pytest.raises(BackendUnavailable) as info:
        load_backend("amdsmi", "c", "n0")
    assert info.value.backend == "amdsmi"
    assert "not installed" in info.value.reason


def test_auto_reports_every_backend_that_could_not_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    loaded, failed = load_backends("auto", "c", "n0")
    assert loaded == []
    assert [f.backend for f in failed] == ["nvml", "amdsmi"]
    loaded, failed = load_backends("nvml,sim", "c", "n0", gpus=2)
    assert [b.name for b in loaded] == ["sim"]
    assert [f.backend for f in failed] == ["nvml"]


def test_unknown_backend_is_named() -> None:
    with pytest.raises(BackendUnavailable, match="choose one of nvml, amdsmi, sim"):
        load_backend("tpu", "c", "n0")


# --------------------------------------------------------------------------- simulator


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_scenario_plays_signals_at_their_time(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("""
gpus: 2
events:
  - {at: 1, gpu: 0, signal: xid, code: 79}
  - {at: 2, gpu: 1, signal: thermal, duration: 5}
  - {at: 2, gpu: 1, node: other-node, signal: lost}
  - {at: 3, gpu: 1, signal: rate, fields: {pcie_replay_count: 2}}
""")
    clock = Clock()
    sim = SimBackend("c", "n0", scenario=Scenario.load(path), clock=clock)
    assert sim.gpu_count() == 2
    assert not any(s.gpu_lost for s in sim.read())
    clock.t += 1.5
    events = sim.wait_events(0.01)
    assert [(e.gpu, e.xid) for e in events] == [(0, 79)]
    clock.t += 1
    s0, s1 = sim.read()
    assert s0.gpu_lost is True  # XID 79 leaves the GPU lost
    assert s1.hw_thermal_slowdown
    assert not s1.gpu_lost
    clock.t += 10
    s1 = sim.read()[1]
    assert not s1.hw_thermal_slowdown  # the slowdown lasted 5 s
    assert s1.pcie_replay_count == pytest.approx(2 * 9.5, abs=1)


def test_live_chaos_requests_inject_faults() -> None:
    clock = Clock()
    sim = SimBackend("c", "n0", gpus=4, clock=clock)
    sim.inject(ChaosRequest(fault="ecc", gpu=2))
    assert [(e.gpu, e.xid) for e in sim.wait_events(0.01)] == [(2, 48)]
    assert sim.read()[2].ecc_volatile_uncorrected == 1
    sim.inject(ChaosRequest(fault="slow", gpu=1, factor=1.7, duration=3))
    sim.inject(ChaosRequest(fault="remap", gpu=3))
    sim.inject(ChaosRequest(fault="nvlink", gpu=0))
    samples = sim.read()
    assert samples[1].extra["slow_factor"] == 1.7
    assert samples[3].remap_pending
    assert samples[0].nvlink_down_links == 1
    assert samples[0].nvlink_recovery_errors == 1
    assert [(e.gpu, e.xid) for e in sim.wait_events(0.01)] == [(0, 74)]
    clock.t += 4
    assert "slow_factor" not in sim.read()[1].extra
    sim.inject(ChaosRequest(fault="clear", gpu=3))
    assert not sim.read()[3].remap_pending
    with pytest.raises(ValueError, match="GPU 9 does not exist"):
        sim.inject(ChaosRequest(fault="xid", gpu=9))


def test_chaos_request_validates_its_fields() -> None:
    with pytest.raises(ValidationError, match="fault"):
        ChaosRequest.model_validate({"fault": "meteor", "gpu": 0})
    req = ChaosRequest.model_validate(
        {"fault": "xid", "gpu": 1, "code": 79, "factor": None, "duration": None}
    )
    assert req.code == 79


def test_a_bad_scenario_names_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"events": [{"at": 1, "signal": "meteor"}]}')
    with pytest.raises(BackendUnavailable, match="signal"):
        load_backend("sim", "c", "n0", scenario=path)
