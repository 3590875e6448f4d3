"""A stand-in ``pynvml`` module: scripted GPUs, the REAL constants, structs and error classes.

Only the device getters are replaced; every constant, every ``NVMLError_*`` class and the
ctypes structures (``c_nvmlFieldValue_t``, ``c_nvmlViolationTime_t``) come from the installed
nvidia-ml-py, so the backend is tested against what the real library raises and returns.
"""

from __future__ import annotations

import collections
import types
from dataclasses import dataclass, field
from typing import Any

import pynvml as real


@dataclass
class FakeGpu:
    """One scripted GPU: getter name -> value, and getter name -> error class to raise."""

    index: int
    values: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, type[Exception]] = field(default_factory=dict)
    # field id -> (nvmlReturn, value); value is read as an unsigned long long / double
    fields: dict[int, tuple[int, float]] = field(default_factory=dict)
    calls: collections.Counter[str] = field(default_factory=collections.Counter)

    def get(self, name: str, *key: Any) -> Any:
        self.calls[name] += 1
        err = self.errors.get(name)
        if err is not None:
            raise err()
        full = (name, *key)
        if full in self.values:
            return self.values[full]
        return self.values[name]


def healthy_values() -> dict[Any, Any]:
    viol = real.c_nvmlViolationTime_t()
    viol.referenceTime = 1
    viol.violationTime = 12345
    return {
        "nvmlDeviceGetName": "NVIDIA H100 80GB HBM3",
        ("nvmlDeviceGetTemperature", real.NVML_TEMPERATURE_GPU): 61,
        ("nvmlDeviceGetTemperatureThreshold", real.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN): 87,
        ("nvmlDeviceGetTemperatureThreshold", real.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN): 92,
        ("nvmlDeviceGetTemperatureThreshold", real.NVML_TEMPERATURE_THRESHOLD_MEM_MAX): 95,
        "nvmlDeviceGetMarginTemperature": 26,
        "nvmlDeviceGetPowerUsage": 312_500,  # milliwatts
        "nvmlDeviceGetEnforcedPowerLimit": 700_000,
        "nvmlDeviceGetTotalEccErrors": 0,
        (
            "nvmlDeviceGetTotalEccErrors",
            real.NVML_MEMORY_ERROR_TYPE_CORRECTED,
            real.NVML_AGGREGATE_ECC,
        ): 17,
        "nvmlDeviceGetMemoryErrorCounter": 0,
        (
            "nvmlDeviceGetMemoryErrorCounter",
            real.NVML_MEMORY_ERROR_TYPE_CORRECTED,
            real.NVML_AGGREGATE_ECC,
            real.NVML_MEMORY_LOCATION_DRAM,
        ): 17,
        "nvmlDeviceGetRetiredPages": [],
        "nvmlDeviceGetRetiredPagesPendingStatus": 0,
        "nvmlDeviceGetRemappedRows": (2, 0, 0, 0),
        "nvmlDeviceGetUnrepairableMemoryFlag_v1": 0,
        "nvmlDeviceGetCurrentClocksEventReasons": 0,
        "nvmlDeviceGetViolationStatus": viol,
        "nvmlDeviceGetPcieReplayCounter": 3,
        "nvmlDeviceGetNvLinkState": real.NVML_FEATURE_ENABLED,
    }


def healthy_fields() -> dict[int, tuple[int, float]]:
    ok = real.NVML_SUCCESS
    return {
        real.NVML_FI_DEV_MEMORY_TEMP: (ok, 58),
        real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: (ok, real.NVML_GPU_RECOVERY_ACTION_NONE),
        real.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: (ok, 4),
        real.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: (ok, 1),
        real.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: (ok, 0),
        real.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: (ok, 0),
    }


def make_gpu(index: int, links: int = 4) -> FakeGpu:
    g = FakeGpu(index, healthy_values(), fields=healthy_fields())
    for link in range(links, real.NVML_NVLINK_MAX_LINKS):
        g.values[("nvmlDeviceGetNvLinkState", link)] = None  # marker: no such link
    return g


class _Events:
    def __init__(self) -> None:
        self.queue: collections.deque[tuple[FakeGpu, int, int]] = collections.deque()
        self.registered: dict[int, int] = {}


def make_module(
    gpus: list[FakeGpu], *, init_error: type[Exception] | None = None
) -> types.ModuleType:
    """A module object that the backend imports as ``pynvml``."""
    m = types.ModuleType("pynvml")
    for name in dir(real):
        if name.startswith(("NVML_", "NVMLError", "nvmlEventType", "nvmlClocks", "c_nvml")):
            setattr(m, name, getattr(real, name))
    state = {"count": len(gpus), "shutdown": 0}
    events = _Events()
    m.state = state  # type: ignore[attr-defined]
    m.events = events  # type: ignore[attr-defined]

    def nvmlInit() -> None:
        if init_error is not None:
            raise init_error()

    def nvmlShutdown() -> None:
        state["shutdown"] += 1

    def nvmlDeviceGetCount() -> int:
        return state["count"]

    def nvmlDeviceGetHandleByIndex(i: int) -> FakeGpu:
        return gpus[i]

    def nvmlDeviceGetIndex(h: FakeGpu) -> int:
        return h.index

    def getter(name: str) -> Any:
        def fn(h: FakeGpu, *args: Any) -> Any:
            value = h.get(name, *args)
            if name == "nvmlDeviceGetNvLinkState" and value is None:
                raise real.NVMLError_InvalidArgument()
            return value

        fn.__name__ = name
        return fn

    for name in (
        "nvmlDeviceGetName",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetTemperatureThreshold",
        "nvmlDeviceGetMarginTemperature",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetMemoryErrorCounter",
        "nvmlDeviceGetRetiredPages",
        "nvmlDeviceGetRetiredPagesPendingStatus",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetUnrepairableMemoryFlag_v1",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetViolationStatus",
        "nvmlDeviceGetPcieReplayCounter",
        "nvmlDeviceGetNvLinkState",
    ):
        setattr(m, name, getter(name))
    m.nvmlDeviceGetCurrentClocksThrottleReasons = m.nvmlDeviceGetCurrentClocksEventReasons

    def nvmlDeviceGetFieldValues(h: FakeGpu, ids: list[int]) -> Any:
        h.calls["nvmlDeviceGetFieldValues"] += 1
        err = h.errors.get("nvmlDeviceGetFieldValues")
        if err is not None:
            raise err()
        out = (real.c_nvmlFieldValue_t * len(ids))()
        for i, fid in enumerate(ids):
            ret, value = h.fields.get(fid, (real.NVML_ERROR_NOT_SUPPORTED, 0))
            out[i].fieldId = fid
            out[i].nvmlReturn = ret
            out[i].valueType = real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            out[i].value.ullVal = int(value)
        return out

    def nvmlEventSetCreate() -> _Events:
        return events

    def nvmlDeviceGetSupportedEventTypes(h: FakeGpu) -> int:
        return int(real.nvmlEventTypeAll)

    def nvmlDeviceRegisterEvents(h: FakeGpu, mask: int, es: _Events) -> None:
        es.registered[h.index] = mask

    def nvmlEventSetWait_v2(es: _Events, timeout_ms: int) -> Any:
        if not es.queue:
            raise real.NVMLError_Timeout()
        gpu, etype, edata = es.queue.popleft()
        return types.SimpleNamespace(
            device=gpu, eventType=etype, eventData=edata, gpuInstanceId=0, computeInstanceId=0
        )

    def nvmlEventSetFree(es: _Events) -> None:
        return None

    for fn in (
        nvmlInit,
        nvmlShutdown,
        nvmlDeviceGetCount,
        nvmlDeviceGetHandleByIndex,
        nvmlDeviceGetIndex,
        nvmlDeviceGetFieldValues,
        nvmlEventSetCreate,
        nvmlDeviceGetSupportedEventTypes,
        nvmlDeviceRegisterEvents,
        nvmlEventSetWait_v2,
        nvmlEventSetFree,
    ):
        setattr(m, fn.__name__, fn)
    return m
