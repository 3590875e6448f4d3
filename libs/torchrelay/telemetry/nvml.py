"""NVIDIA GPUs through NVML (``nvidia-ml-py``, imported as ``pynvml``).

Every signal of docs/design.md §5 is read field by field: a field that raises
``NVMLError_NotSupported`` is remembered and skipped afterwards, ``NVMLError_GpuIsLost`` and
``NVMLError_ResetRequired`` mark the sample (``gpu_lost`` / ``reset_required``) and the other
fields are still read, any other NVML error loses only that field. Critical events come from
``nvmlEventSetWait_v2`` on the agent's event thread.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torchrelay.contract import TelemetrySample
from torchrelay.telemetry.base import BackendUnavailable

log = logging.getLogger("torchrelay.telemetry.nvml")

# Clock-event (throttle) reason bits, as in nvml.h (nvmlClocksEventReason*).
HW_SLOWDOWN = 0x08
SW_THERMAL_SLOWDOWN = 0x20
HW_THERMAL_SLOWDOWN = 0x40
HW_POWER_BRAKE_SLOWDOWN = 0x80

# XIDs that the event mapping synthesises for non-XID critical events.
XID_DOUBLE_BIT_ECC = 48
XID_GPU_LOST = 79

_ECC_LOCATIONS = (
    ("l1", "NVML_MEMORY_LOCATION_L1_CACHE"),
    ("l2", "NVML_MEMORY_LOCATION_L2_CACHE"),
    ("dram", "NVML_MEMORY_LOCATION_DRAM"),
    ("rf", "NVML_MEMORY_LOCATION_REGISTER_FILE"),
    ("tex", "NVML_MEMORY_LOCATION_TEXTURE_MEMORY"),
    ("shm", "NVML_MEMORY_LOCATION_TEXTURE_SHM"),
    ("cbu", "NVML_MEMORY_LOCATION_CBU"),
    ("sram", "NVML_MEMORY_LOCATION_SRAM"),
)
_VIOLATION_POLICIES = (
    ("power", "NVML_PERF_POLICY_POWER"),
    ("thermal", "NVML_PERF_POLICY_THERMAL"),
    ("reliability", "NVML_PERF_POLICY_RELIABILITY"),
    ("board_limit", "NVML_PERF_POLICY_BOARD_LIMIT"),
)
# Field-value ids read in one nvmlDeviceGetFieldValues call: sample attribute → constant.
_FIELDS = (
    ("memory_temperature_c", "NVML_FI_DEV_MEMORY_TEMP"),
    ("recovery_action", "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"),
    ("nvlink_crc_flit", "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"),
    ("nvlink_crc_data", "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"),
    ("nvlink_replay_errors", "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"),
    ("nvlink_recovery_errors", "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"),
)
# Event types the event thread registers for, when the device supports them.
_EVENT_NAMES = (
    "nvmlEventTypeXidCriticalError",
    "nvmlEventTypeDoubleBitEccError",
    "nvmlEventTypeGpuUnavailableError",
    "nvmlEventTypeGpuRecoveryAction",
    "nvmlEventTypeDramRetirementFailure",
    "nvmlEventTypeFatalPoisonError",
)


class _GpuRead:
    """What one poll of one GPU found beyond the values: lost, reset required, errors."""

    __slots__ = ("errors", "lost", "reset_required")

    def __init__(self) -> None:
        self.lost = False
        self.reset_required = False
        self.errors: dict[str, str] = {}


def _value_of(field: Any, nv: ModuleType) -> float | None:
    """The number in an ``nvmlFieldValue_t`` (its union member chosen by ``valueType``)."""
    kind = int(field.valueType)
    v = field.value
    by_type: dict[int, str] = {
        nv.NVML_VALUE_TYPE_DOUBLE: "dVal",
        nv.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        nv.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        nv.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_SHORT", 6): "usVal",
    }
    attr = by_type.get(kind)
    return None if attr is None else float(getattr(v, attr))


class NvmlBackend:
    """Telemetry of every NVIDIA GPU of this node through NVML.

    Args:
        cluster: the cluster name stamped on every sample.
        node: this node's name.
        module: a ``pynvml``-compatible module (tests pass a stand-in); default: import it.

    Raises:
        BackendUnavailable: ``nvidia-ml-py`` is not installed, or NVML would not initialise
            (no driver, no ``libnvidia-ml.so``, no permission).
    """

    name = "nvml"

    def __init__(self, cluster: str, node: str, module: ModuleType | None = None) -> None:
        self.cluster = cluster
        self.node = node
        if module is None:
            try:
                module = importlib.import_module("pynvml")
            except ImportError as exc:
                raise BackendUnavailable(
                    "nvml",
                    f"the Python package nvidia-ml-py is not installed ({exc}); "
                    "install it with 'pip install nvidia-ml-py'",
                ) from exc
        self.nv = module
        try:
            module.nvmlInit()
        except module.NVMLError as exc:
            raise BackendUnavailable(
                "nvml",
                f"nvmlInit failed: {exc} (is the NVIDIA driver loaded and "
                "libnvidia-ml.so on the library path?)",
            ) from exc
        except OSError as exc:
            raise BackendUnavailable("nvml", f"NVML library could not load: {exc}") from exc
        self._closed = False
        self._lock = threading.Lock()
        self._unsupported: set[tuple[int, str]] = set()
        self._handles: list[Any] = []
        self._models: dict[int, str] = {}
        try:
            count = int(module.nvmlDeviceGetCount())
        except module.NVMLError as exc:
            module.nvmlShutdown()
            raise BackendUnavailable("nvml", f"nvmlDeviceGetCount failed: {exc}") from exc
        self._initial_count = count
        for index in range(count):
            try:
                self._handles.append(module.nvmlDeviceGetHandleByIndex(index))
            except module.NVMLError as exc:
                # A GPU that is already lost at start still counts: its samples say so.
                log.warning("GPU %d: no handle (%s)", index, exc)
                self._handles.append(None)
        self._event_set: Any = None
        self._event_setup_done = False

    # ----------------------------------------------------------------- helpers

    def _get(
        self, gpu: int, status: _GpuRead, name: str, fn: Callable[..., Any], *args: Any
    ) -> Any:
        """Call one NVML getter; classify its failure without losing the other fields."""
        if (gpu, name) in self._unsupported:
            return None
        nv = self.nv
        try:
            return fn(*args)
        except nv.NVMLError_GpuIsLost:
            status.lost = True
        except nv.NVMLError_ResetRequired:
            status.reset_required = True
        except (
            nv.NVMLError_NotSupported,
            nv.NVMLError_FunctionNotFound,
            nv.NVMLError_InvalidArgument,
        ):
            # Not on this device (or this driver): do not ask again every poll.
            self._unsupported.add((gpu, name))
        except nv.NVMLError as exc:
            status.errors[name] = str(exc)
        return None

    def gpu_count(self) -> int:
        """GPUs NVML sees now (a drop below the count at start marks the missing ones lost)."""
        try:
            return int(self.nv.nvmlDeviceGetCount())
        except self.nv.NVMLError:
            return 0

    # ----------------------------------------------------------------- polling

    def read(self) -> list[TelemetrySample]:
        """Read every signal of every GPU; see the module docstring for error handling."""
        with self._lock:
            now_count = self.gpu_count()
            samples = []
            for index, handle in enumerate(self._handles):
                if handle is None or index >= now_count:
                    samples.append(
                        TelemetrySample(
                            cluster=self.cluster,
                            node=self.node,
                            gpu=index,
                            backend="nvml",
                            gpu_lost=True,
                            extra={
                                "gpu_count": float(now_count),
                                "gpu_count_at_start": float(self._initial_count),
                            },
                        )
                    )
                    continue
                samples.append(self._read_gpu(index, handle))
            return samples

    def _read_gpu(self, gpu: int, h: Any) -> TelemetrySample:
        nv = self.nv
        st = _GpuRead()
        values: dict[str, Any] = {}
        extra: dict[str, float] = {}

        def get(name: str, fn: Callable[..., Any], *args: Any) -> Any:
            return self._get(gpu, st, name, fn, *args)

        if gpu not in self._models:
            model = get("name", nv.nvmlDeviceGetName, h)
            if model is not None:
                self._models[gpu] = model.decode() if isinstance(model, bytes) else str(model)
        values["gpu_model"] = self._models.get(gpu)

        # Temperatures and thresholds.
        values["temperature_c"] = get(
            "temp", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU
        )
        values["temp_slowdown_c"] = get(
            "temp_slowdown",
            nv.nvmlDeviceGetTemperatureThreshold,
            h,
            nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
        )
        values["temp_shutdown_c"] = get(
            "temp_shutdown",
            nv.nvmlDeviceGetTemperatureThreshold,
            h,
            nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN,
        )
        mem_max = get(
            "temp_mem_max",
            nv.nvmlDeviceGetTemperatureThreshold,
            h,
            nv.NVML_TEMPERATURE_THRESHOLD_MEM_MAX,
        )
        if mem_max is not None:
            extra["temp_mem_max_c"] = float(mem_max)
        margin = get("temp_margin", nv.nvmlDeviceGetMarginTemperature, h)
        if margin is not None:
            extra["temp_margin_c"] = float(margin)

        # Power (NVML reports milliwatts).
        power = get("power", nv.nvmlDeviceGetPowerUsage, h)
        values["power_w"] = None if power is None else power / 1000.0
        limit = get("power_limit", nv.nvmlDeviceGetEnforcedPowerLimit, h)
        values["power_limit_w"] = None if limit is None else limit / 1000.0

        # ECC totals, volatile and aggregate.
        for key, err, counter in (
            ("ecc_volatile_corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
            (
                "ecc_volatile_uncorrected",
                nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_VOLATILE_ECC,
            ),
            ("ecc_aggregate_corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC),
            (
                "ecc_aggregate_uncorrected",
                nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_AGGREGATE_ECC,
            ),
        ):
            values[key] = get(key, nv.nvmlDeviceGetTotalEccErrors, h, err, counter)
        # ECC per location: extra["ecc_<vol|agg>_<corr|unc>_<location>"].
        for loc_name, loc_const in _ECC_LOCATIONS:
            loc = getattr(nv, loc_const, None)
            if loc is None:
                continue
            for ctr_name, counter in (
                ("vol", nv.NVML_VOLATILE_ECC),
                ("agg", nv.NVML_AGGREGATE_ECC),
            ):
                for err_name, err in (
                    ("corr", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                    ("unc", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
                ):
                    key = f"ecc_{ctr_name}_{err_name}_{loc_name}"
                    v = get(key, nv.nvmlDeviceGetMemoryErrorCounter, h, err, counter, loc)
                    if v is not None:
                        extra[key] = float(v)

        # Retired pages (pre-Ampere) and remapped rows (Ampere and later).
        pages = 0
        any_pages = False
        for cause in (
            nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        ):
            got = get(f"retired_pages_{cause}", nv.nvmlDeviceGetRetiredPages, h, cause)
            if got is not None:
                any_pages = True
                pages += len(got)
        values["retired_pages"] = pages if any_pages else None
        pending = get("retired_pending", nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
        if pending is not None:
            extra["retired_pages_pending"] = float(pending)
        rows = get("remapped_rows", nv.nvmlDeviceGetRemappedRows, h)
        if rows is not None:
            corr, unc, is_pending, failure = rows
            values["remapped_rows_correctable"] = int(corr)
            values["remapped_rows_uncorrectable"] = int(unc)
            values["remap_pending"] = bool(is_pending)
            values["remap_failure"] = bool(failure)
        unrepairable_fn = getattr(nv, "nvmlDeviceGetUnrepairableMemoryFlag_v1", None)
        if unrepairable_fn is not None:
            flag = get("unrepairable", unrepairable_fn, h)
            values["unrepairable_memory"] = None if flag is None else bool(flag)

        # Clock-event (throttle) reasons and violation counters.
        reasons_fn = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        reasons = get("clock_events", reasons_fn, h)
        if reasons is not None:
            reasons = int(reasons)
            values["clock_event_reasons"] = reasons
            values["hw_slowdown"] = bool(reasons & (HW_SLOWDOWN | HW_POWER_BRAKE_SLOWDOWN))
            values["hw_thermal_slowdown"] = bool(reasons & HW_THERMAL_SLOWDOWN)
            values["sw_thermal_slowdown"] = bool(reasons & SW_THERMAL_SLOWDOWN)
        for pol_name, pol_const in _VIOLATION_POLICIES:
            pol = getattr(nv, pol_const, None)
            if pol is None:
                continue
            viol = get(f"violation_{pol_name}", nv.nvmlDeviceGetViolationStatus, h, pol)
            if viol is not None:
                extra[f"violation_{pol_name}_ns"] = float(viol.violationTime)

        # PCIe replays.
        values["pcie_replay_count"] = get("pcie_replay", nv.nvmlDeviceGetPcieReplayCounter, h)

        # NVLink state per link.
        down = 0
        links = 0
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
            state = get(f"nvlink_state_{link}", nv.nvmlDeviceGetNvLinkState, h, link)
            if state is None:
                continue
            links += 1
            if int(state) != nv.NVML_FEATURE_ENABLED:
                down += 1
        if links:
            values["nvlink_down_links"] = down
            extra["nvlink_links"] = float(links)

        # Field values: memory temperature, recovery action, NVLink error totals.
        self._read_fields(gpu, h, st, values, extra)

        if st.errors:
            extra["read_errors"] = float(len(st.errors))
            log.debug("GPU %d: fields failed: %s", gpu, st.errors)
        clean = {k: v for k, v in values.items() if v is not None}
        return TelemetrySample(
            cluster=self.cluster,
            node=self.node,
            gpu=gpu,
            backend="nvml",
            gpu_lost=True if st.lost else None,
            reset_required=True if st.reset_required else None,
            extra=extra,
            **clean,
        )

    def _read_fields(
        self, gpu: int, h: Any, st: _GpuRead, values: dict[str, Any], extra: dict[str, float]
    ) -> None:
        nv = self.nv
        wanted = [
            (attr, getattr(nv, const))
            for attr, const in _FIELDS
            if hasattr(nv, const) and (gpu, f"field_{attr}") not in self._unsupported
        ]
        if not wanted:
            return
        got = self._get(
            gpu, st, "field_values", nv.nvmlDeviceGetFieldValues, h, [fid for _, fid in wanted]
        )
        if got is None:
            return
        crc = 0.0
        crc_seen = False
        for (attr, _fid), field in zip(wanted, got, strict=False):
            ret = int(field.nvmlReturn)
            if ret == nv.NVML_ERROR_GPU_IS_LOST:
                st.lost = True
                continue
            if ret == nv.NVML_ERROR_RESET_REQUIRED:
                st.reset_required = True
                continue
            if ret == nv.NVML_ERROR_NOT_SUPPORTED:
                self._unsupported.add((gpu, f"field_{attr}"))
                continue
            if ret != nv.NVML_SUCCESS:
                st.errors[f"field_{attr}"] = f"nvmlReturn {ret}"
                continue
            value = _value_of(field, nv)
            if value is None:
                continue
            if attr in ("nvlink_crc_flit", "nvlink_crc_data"):
                crc += value
                crc_seen = True
            elif attr in ("recovery_action", "nvlink_replay_errors", "nvlink_recovery_errors"):
                values[attr] = int(value)
            else:
                values[attr] = value
        if crc_seen:
            values["nvlink_crc_errors"] = int(crc)

    # ----------------------------------------------------------------- events

    def _setup_events(self) -> None:
        nv = self.nv
        self._event_setup_done = True
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            log.warning("NVML events unavailable (nvmlEventSetCreate: %s); polling only", exc)
            return
        wanted = 0
        for name in _EVENT_NAMES:
            wanted |= int(getattr(nv, name, 0))
        for index, h in enumerate(self._handles):
            if h is None:
                continue
            try:
                supported = int(nv.nvmlDeviceGetSupportedEventTypes(h))
                mask = supported & wanted
                if mask:
                    nv.nvmlDeviceRegisterEvents(h, mask, self._event_set)
            except nv.NVMLError as exc:
                log.warning("GPU %d: cannot register NVML events: %s", index, exc)

    def wait_events(self, timeout_s: float) -> list[TelemetrySample]:
        """Wait for XID and other critical events (``nvmlEventSetWait_v2``)."""
        nv = self.nv
        if not self._event_setup_done:
            self._setup_events()
        if self._event_set is None or self._closed:
            threading.Event().wait(timeout_s)
            return []
        try:
            data = nv.nvmlEventSetWait_v2(self._event_set, max(1, int(timeout_s * 1000)))
        except nv.NVMLError_Timeout:
            return []
        except nv.NVMLError_GpuIsLost:
            return [
                TelemetrySample(
                    cluster=self.cluster,
                    node=self.node,
                    gpu=0,
                    backend="nvml",
                    gpu_lost=True,
                    xid=XID_GPU_LOST,
                )
            ]
        except nv.NVMLError as exc:
            log.warning("nvmlEventSetWait_v2 failed: %s", exc)
            threading.Event().wait(min(timeout_s, 1.0))
            return []
        return [self._event_sample(data)]

    def _event_sample(self, data: Any) -> TelemetrySample:
        nv = self.nv
        try:
            gpu = int(nv.nvmlDeviceGetIndex(data.device))
        except nv.NVMLError:
            gpu = 0
        etype = int(data.eventType)
        edata = int(data.eventData)
        fields: dict[str, Any] = {"extra": {"event_type": float(etype), "event_data": float(edata)}}
        if etype & int(getattr(nv, "nvmlEventTypeXidCriticalError", 0)):
            fields["xid"] = edata
        elif etype & int(getattr(nv, "nvmlEventTypeDoubleBitEccError", 0)):
            fields["xid"] = XID_DOUBLE_BIT_ECC
        elif etype & int(getattr(nv, "nvmlEventTypeGpuUnavailableError", 0)):
            fields["gpu_lost"] = True
        elif etype & int(getattr(nv, "nvmlEventTypeGpuRecoveryAction", 0)):
            fields["recovery_action"] = edata
        elif etype & int(getattr(nv, "nvmlEventTypeDramRetirementFailure", 0)):
            fields["remap_failure"] = True
        elif etype & int(getattr(nv, "nvmlEventTypeFatalPoisonError", 0)):
            fields["extra"]["fatal_poison"] = 1.0
        return TelemetrySample(
            cluster=self.cluster,
            node=self.node,
            gpu=gpu,
            backend="nvml",
            gpu_model=self._models.get(gpu),
            **fields,
        )

    def close(self) -> None:
        """Free the event set and shut NVML down."""
        if self._closed:
            return
        self._closed = True
        nv = self.nv
        if self._event_set is not None:
            try:
                nv.nvmlEventSetFree(self._event_set)
            except nv.NVMLError as exc:
                log.debug("nvmlEventSetFree: %s", exc)
        try:
            nv.nvmlShutdown()
        except nv.NVMLError as exc:
            log.debug("nvmlShutdown: %s", exc)


__all__ = ["NvmlBackend"]
