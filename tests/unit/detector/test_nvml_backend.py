"""The NVML backend against a stand-in ``pynvml`` raising the real nvidia-ml-py errors."""

from __future__ import annotations

import sys

import pynvml as real
import pytest

from services.detector.rules import DetectorConfig, GpuWindows, evaluate_sample
from tests.unit.detector.fake_pynvml import make_gpu, make_module
from torchrelay.contract import FaultKind
from torchrelay.telemetry import BackendUnavailable, load_backend
from torchrelay.telemetry.nvml import NvmlBackend


def backend(gpus: int = 2) -> tuple[NvmlBackend, list]:  # type: ignore[type-arg]
    fakes = [make_gpu(i) for i in range(gpus)]
    return NvmlBackend("c", "n0", module=make_module(fakes)), fakes


def test_reads_every_signal_of_a_healthy_gpu() -> None:
    b, _ = backend()
    s = b.read()[1]
    assert (s.gpu, s.backend, s.gpu_model) == (1, "nvml", "NVIDIA H100 80GB HBM3")
    assert (s.temperature_c, s.temp_slowdown_c, s.temp_shutdown_c) == (61, 87, 92)
    assert s.memory_temperature_c == 58
    assert s.extra["temp_mem_max_c"] == 95
    assert s.extra["temp_margin_c"] == 26
    assert (s.power_w, s.power_limit_w) == (312.5, 700.0)
    assert (s.ecc_volatile_corrected, s.ecc_volatile_uncorrected) == (0, 0)
    assert (s.ecc_aggregate_corrected, s.ecc_aggregate_uncorrected) == (17, 0)
    assert s.extra["ecc_agg_corr_dram"] == 17
    assert s.extra["ecc_vol_unc_l2"] == 0
    assert (s.remapped_rows_correctable, s.remapped_rows_uncorrectable) == (2, 0)
    assert (s.remap_pending, s.remap_failure, s.unrepairable_memory) == (False, False, False)
    assert s.retired_pages == 0
    assert (s.clock_event_reasons, s.hw_slowdown, s.hw_thermal_slowdown) == (0, False, False)
    assert s.extra["violation_thermal_ns"] == 12345
    assert s.pcie_replay_count == 3
    assert (s.nvlink_down_links, s.extra["nvlink_links"]) == (0, 4)
    assert (s.nvlink_crc_errors, s.nvlink_replay_errors, s.nvlink_recovery_errors) == (5, 0, 0)
    assert s.recovery_action == 0
    assert s.gpu_lost is None
    assert s.reset_required is None
    assert evaluate_sample(GpuWindows(DetectorConfig()), s, DetectorConfig()) == []


def test_clock_event_reasons_decode_to_slowdown_flags() -> None:
    b, fakes = backend(1)
    fakes[0].values["nvmlDeviceGetCurrentClocksEventReasons"] = (
        real.nvmlClocksEventReasonHwSlowdown | real.nvmlClocksEventReasonHwThermalSlowdown
    )
    s = b.read()[0]
    assert s.hw_slowdown
    assert s.hw_thermal_slowdown
    assert not s.sw_thermal_slowdown


def test_not_supported_loses_only_that_field_and_is_not_asked_again() -> None:
    b, fakes = backend(1)
    fakes[0].errors["nvmlDeviceGetTemperature"] = real.NVMLError_NotSupported
    fakes[0].errors["nvmlDeviceGetRemappedRows"] = real.NVMLError_NotSupported
    first = b.read()[0]
    b.read()
    assert first.temperature_c is None
    assert first.remap_pending is None
    assert first.power_w == 312.5
    assert first.temp_slowdown_c == 87
    assert first.gpu_lost is None
    assert fakes[0].calls["nvmlDeviceGetTemperature"] == 1  # remembered as unsupported
    assert fakes[0].calls["nvmlDeviceGetPowerUsage"] == 2


def test_gpu_is_lost_on_one_field_marks_the_sample_and_keeps_the_rest() -> None:
    b, fakes = backend(2)
    fakes[1].errors["nvmlDeviceGetPowerUsage"] = real.NVMLError_GpuIsLost
    s0, s1 = b.read()
    assert s0.gpu_lost is None
    assert s1.gpu_lost is True
    assert s1.power_w is None
    assert s1.temperature_c == 61
    assert s1.pcie_replay_count == 3
    assert fakes[1].calls["nvmlDeviceGetPowerUsage"] == 1
    b.read()
    assert fakes[1].calls["nvmlDeviceGetPowerUsage"] == 2  # lost is not "unsupported"
    cfg = DetectorConfig()
    assert {f.kind for f in evaluate_sample(GpuWindows(cfg), s1, cfg)} == {FaultKind.GPU_LOST}


def test_reset_required_is_reported() -> None:
    b, fakes = backend(1)
    fakes[0].errors["nvmlDeviceGetTotalEccErrors"] = real.NVMLError_ResetRequired
    s = b.read()[0]
    assert s.reset_required is True
    assert s.ecc_volatile_uncorrected is None
    assert s.temperature_c == 61


def test_other_nvml_errors_lose_one_field_only() -> None:
    b, fakes = backend(1)
    fakes[0].errors["nvmlDeviceGetPcieReplayCounter"] = real.NVMLError_Unknown
    s = b.read()[0]
    assert s.pcie_replay_count is None
    assert s.extra["read_errors"] == 1
    assert s.gpu_lost is None
    assert s.temperature_c == 61


def test_field_values_are_handled_per_entry() -> None:
    b, fakes = backend(1)
    fakes[0].fields[real.NVML_FI_DEV_MEMORY_TEMP] = (real.NVML_ERROR_NOT_SUPPORTED, 0)
    fakes[0].fields[real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION] = (
        real.NVML_SUCCESS,
        real.NVML_GPU_RECOVERY_ACTION_GPU_RESET,
    )
    fakes[0].fields[real.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL] = (
        real.NVML_ERROR_GPU_IS_LOST,
        0,
    )
    s = b.read()[0]
    assert s.memory_temperature_c is None
    assert s.recovery_action == real.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    assert s.gpu_lost is True
    assert s.nvlink_crc_errors == 5  # the other entries of the same call


def test_a_remap_failure_and_the_unrepairable_flag_are_read() -> None:
    b, fakes = backend(1)
    fakes[0].values["nvmlDeviceGetRemappedRows"] = (2, 1, 1, 1)
    fakes[0].values["nvmlDeviceGetUnrepairableMemoryFlag_v1"] = 1
    s = b.read()[0]
    assert (s.remap_pending, s.remap_failure, s.unrepairable_memory) == (True, True, True)
    assert s.remapped_rows_uncorrectable == 1


def test_a_link_down_is_counted() -> None:
    b, fakes = backend(1)
    fakes[0].values[("nvmlDeviceGetNvLinkState", 2)] = real.NVML_FEATURE_DISABLED
    assert b.read()[0].nvlink_down_links == 1


def test_gpu_count_drop_reports_the_missing_gpu_lost() -> None:
    fakes = [make_gpu(i) for i in range(4)]
    mod = make_module(fakes)
    b = NvmlBackend("c", "n0", module=mod)
    mod.state["count"] = 3  # type: ignore[attr-defined]
    samples = b.read()
    assert [s.gpu_lost for s in samples] == [None, None, None, True]
    assert samples[3].extra["gpu_count"] == 3


def test_xid_and_critical_events_come_from_the_event_set() -> None:
    fakes = [make_gpu(i) for i in range(2)]
    mod = make_module(fakes)
    b = NvmlBackend("c", "n0", module=mod)
    assert b.wait_events(0.01) == []  # NVMLError_Timeout: nothing happened
    assert set(mod.events.registered) == {0, 1}  # type: ignore[attr-defined]
    mask = mod.events.registered[0]  # type: ignore[attr-defined]
    assert mask & real.nvmlEventTypeXidCriticalError
    mod.events.queue.append((fakes[1], real.nvmlEventTypeXidCriticalError, 79))  # type: ignore[attr-defined]
    mod.events.queue.append((fakes[0], real.nvmlEventTypeDoubleBitEccError, 0))  # type: ignore[attr-defined]
    mod.events.queue.append((fakes[0], real.nvmlEventTypeGpuRecoveryAction, 2))  # type: ignore[attr-defined]
    first, second, third = (b.wait_events(0.01)[0] for _ in range(3))
    assert (first.gpu, first.xid) == (1, 79)
    assert (second.gpu, second.xid) == (0, 48)
    assert third.recovery_action == 2


def test_nvml_that_cannot_initialise_says_which_and_why() -> None:
    mod = make_module([], init_error=real.NVMLError_DriverNotLoaded)
    with pytest.raises(BackendUnavailable) as info:
        NvmlBackend("c", "n0", module=mod)
    assert info.value.backend == "nvml"
    assert "Driver Not Loaded" in str(info.value)
    assert "driver" in info.value.reason


def test_load_backend_imports_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = make_module([make_gpu(0)])
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    b = load_backend("nvml", "c", "n0")
    assert b.name == "nvml"
    assert b.gpu_count() == 1
    b.close()
    b.close()
    assert mod.state["shutdown"] == 1  # type: ignore[attr-defined]


def test_the_gpu_script_prints_every_signal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """tests/gpu/read_nvml.py, run here against the stand-in (on a GPU machine: the real one)."""
    import importlib.util
    from pathlib import Path

    fakes = [make_gpu(0), make_gpu(1)]
    fakes[1].errors["nvmlDeviceGetTemperature"] = real.NVMLError_NotSupported
    mod = make_module(fakes)
    mod.events.queue.append((fakes[0], real.nvmlEventTypeXidCriticalError, 79))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    path = Path(__file__).resolve().parents[2] / "gpu" / "read_nvml.py"
    spec = importlib.util.spec_from_file_location("read_nvml", path)
    assert spec is not None
    assert spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--events", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "GPU 1: NVIDIA H100 80GB HBM3" in out
    assert "pcie_replay_count" in out
    assert "extra.ecc_agg_corr_dram" in out
    unsupported = [line for line in out.splitlines() if "not supported here" in line]
    assert "temp" in unsupported[-1].split(": ", 1)[1].split(", ")  # GPU 1's temperature
    assert '"xid":79' in out
