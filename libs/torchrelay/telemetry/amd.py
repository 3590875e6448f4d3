"""AMD GPUs through AMD SMI (``amdsmi``, the optional extra ``torchrelay[amd]``).

Reads ECC totals and per block, bad (retired) pages, temperature metrics with their
critical/emergency thresholds, power and its limit, violation (throttle) status, the PCIe
replay counter, and critical events from ``AmdSmiEventReader``. As with NVML, each field is
read on its own: a field the device does not support (or that fails) is left ``None``.

This backend is tested against a stand-in ``amdsmi`` module only; no AMD GPU was at hand.
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

log = logging.getLogger("torchrelay.telemetry.amd")

# ECC blocks read one by one (AmdSmiGpuBlock member names).
_ECC_BLOCKS = (
    "UMC",
    "SDMA",
    "GFX",
    "MMHUB",
    "ATHUB",
    "PCIE_BIF",
    "HDP",
    "XGMI_WAFL",
    "DF",
    "SMN",
    "SEM",
    "MP0",
    "MP1",
    "FUSE",
)
# Events the event reader subscribes to (AmdSmiEvtNotificationType member names).
_EVENT_TYPES = ("GPU_PRE_RESET", "GPU_POST_RESET", "RING_HANG", "VMFAULT", "THERMAL_THROTTLE")
# Events that mean the GPU went away or hung: reported as lost / firmware hang XIDs.
XID_GPU_LOST = 79
XID_FIRMWARE_HANG = 119


def _num(value: Any) -> float | None:
    """AMD SMI returns "N/A" for unsupported values; keep numbers only."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


class AmdSmiBackend:
    """Telemetry of every AMD GPU of this node through AMD SMI.

    Args:
        cluster: the cluster name stamped on every sample.
        node: this node's name.
        module: an ``amdsmi``-compatible module (tests pass a stand-in); default: import it.

    Raises:
        BackendUnavailable: ``amdsmi`` is not installed or ``amdsmi_init`` failed.
    """

    name = "amdsmi"

    def __init__(self, cluster: str, node: str, module: ModuleType | None = None) -> None:
        self.cluster = cluster
        self.node = node
        if module is None:
            try:
                module = importlib.import_module("amdsmi")
            except ImportError as exc:
                raise BackendUnavailable(
                    "amdsmi",
                    f"the Python package amdsmi is not installed ({exc}); install "
                    "it with \"pip install 'torchrelay[amd]'\" or from /opt/rocm/share/amd_smi",
                ) from exc
            except OSError as exc:  # the wrapper loads libamd_smi.so at import
                raise BackendUnavailable("amdsmi", f"libamd_smi could not load: {exc}") from exc
        self.smi = module
        try:
            module.amdsmi_init()
            self._handles: list[Any] = list(module.amdsmi_get_processor_handles())
        except module.AmdSmiException as exc:
            raise BackendUnavailable(
                "amdsmi", f"amdsmi_init failed: {exc} (is the amdgpu driver loaded?)"
            ) from exc
        self._unsupported: set[tuple[int, str]] = set()
        self._closed = False
        self._reader: Any = None
        self._reader_done = False
        self._models: dict[int, str] = {}

    def _get(
        self, gpu: int, errors: dict[str, str], name: str, fn: Callable[..., Any], *args: Any
    ) -> Any:
        if (gpu, name) in self._unsupported:
            return None
        smi = self.smi
        try:
            return fn(*args)
        except smi.AmdSmiLibraryException as exc:
            code = getattr(exc, "err_code", None)
            if code in (
                getattr(smi.amdsmi_wrapper, "AMDSMI_STATUS_NOT_SUPPORTED", -1),
                getattr(smi.amdsmi_wrapper, "AMDSMI_STATUS_NOT_YET_IMPLEMENTED", -1),
            ):
                self._unsupported.add((gpu, name))
            else:
                errors[name] = str(exc)
        except smi.AmdSmiException as exc:
            errors[name] = str(exc)
        return None

    def gpu_count(self) -> int:
        """GPUs AMD SMI sees now."""
        try:
            return len(self.smi.amdsmi_get_processor_handles())
        except self.smi.AmdSmiException:
            return 0

    def read(self) -> list[TelemetrySample]:
        """One sample per GPU; a GPU gone from the handle list is reported lost."""
        now_count = self.gpu_count()
        out = []
        for index, h in enumerate(self._handles):
            if index >= now_count:
                out.append(
                    TelemetrySample(
                        cluster=self.cluster,
                        node=self.node,
                        gpu=index,
                        backend="amdsmi",
                        gpu_lost=True,
                    )
                )
                continue
            out.append(self._read_gpu(index, h))
        return out

    def _read_gpu(self, gpu: int, h: Any) -> TelemetrySample:
        smi = self.smi
        errors: dict[str, str] = {}
        values: dict[str, Any] = {}
        extra: dict[str, float] = {}

        def get(name: str, fn: Callable[..., Any], *args: Any) -> Any:
            return self._get(gpu, errors, name, fn, *args)

        if gpu not in self._models:
            asic = get("asic", smi.amdsmi_get_gpu_asic_info, h)
            if isinstance(asic, dict) and isinstance(asic.get("market_name"), str):
                self._models[gpu] = asic["market_name"]
        values["gpu_model"] = self._models.get(gpu)

        total = get("ecc_total", smi.amdsmi_get_gpu_total_ecc_count, h)
        if isinstance(total, dict):
            corr = _num(total.get("correctable_count"))
            unc = _num(total.get("uncorrectable_count"))
            # AMD SMI's counts are since driver load: the volatile counters of NVML's model.
            values["ecc_volatile_corrected"] = None if corr is None else int(corr)
            values["ecc_volatile_uncorrected"] = None if unc is None else int(unc)
            deferred = _num(total.get("deferred_count"))
            if deferred is not None:
                extra["ecc_deferred"] = deferred
        block_enum = getattr(smi, "AmdSmiGpuBlock", None)
        for block in _ECC_BLOCKS:
            member = getattr(block_enum, block, None) if block_enum is not None else None
            if member is None:
                continue
            got = get(f"ecc_{block}", smi.amdsmi_get_gpu_ecc_count, h, member)
            if isinstance(got, dict):
                for key, short in (("correctable_count", "corr"), ("uncorrectable_count", "unc")):
                    v = _num(got.get(key))
                    if v is not None:
                        extra[f"ecc_{short}_{block.lower()}"] = v

        pages = get("bad_pages", smi.amdsmi_get_gpu_bad_page_info, h)
        if isinstance(pages, list):
            values["retired_pages"] = len(pages)
            pending = sum(
                1
                for p in pages
                if isinstance(p, dict) and str(p.get("status", "")).upper().endswith("PENDING")
            )
            values["remap_pending"] = pending > 0
            unreservable = sum(
                1
                for p in pages
                if isinstance(p, dict) and str(p.get("status", "")).upper().endswith("UNRESERVABLE")
            )
            values["unrepairable_memory"] = unreservable > 0

        ttype = getattr(smi, "AmdSmiTemperatureType", None)
        tmetric = getattr(smi, "AmdSmiTemperatureMetric", None)
        if ttype is not None and tmetric is not None:
            for attr, sensor, metric in (
                ("temperature_c", "HOTSPOT", "CURRENT"),
                ("temp_slowdown_c", "HOTSPOT", "CRITICAL"),
                ("temp_shutdown_c", "HOTSPOT", "EMERGENCY"),
                ("memory_temperature_c", "VRAM", "CURRENT"),
            ):
                s = getattr(ttype, sensor, None)
                m = getattr(tmetric, metric, None)
                if s is None or m is None:
                    continue
                values[attr] = _num(
                    get(f"temp_{sensor}_{metric}", smi.amdsmi_get_temp_metric, h, s, m)
                )
            edge = getattr(ttype, "EDGE", None)
            cur = getattr(tmetric, "CURRENT", None)
            if edge is not None and cur is not None:
                v = _num(get("temp_edge", smi.amdsmi_get_temp_metric, h, edge, cur))
                if v is not None:
                    extra["temp_edge_c"] = v

        power = get("power", smi.amdsmi_get_power_info, h)
        if isinstance(power, dict):
            values["power_w"] = _num(power.get("current_socket_power")) or _num(
                power.get("average_socket_power")
            )
            limit = _num(power.get("power_limit"))
            # Newer AMD SMI reports the limit in microwatts; older ones in watts.
            values["power_limit_w"] = (
                None if limit is None else (limit / 1e6 if limit > 1e5 else limit)
            )

        viol = get("violation", smi.amdsmi_get_violation_status, h)
        if isinstance(viol, dict):
            active = {
                k: bool(v)
                for k, v in viol.items()
                if k.startswith("active_") and isinstance(v, bool | int)
            }
            thermal = any(
                active.get(k, False)
                for k in (
                    "active_prochot_thrm",
                    "active_socket_thrm",
                    "active_vr_thrm",
                    "active_hbm_thrm",
                )
            )
            values["hw_thermal_slowdown"] = thermal
            values["hw_slowdown"] = thermal or active.get("active_ppt_pwr", False)
            for k, v in viol.items():
                n = _num(v)
                if n is not None and (k.startswith(("acc_", "per_"))):
                    extra[f"violation_{k}"] = n

        replay = get("pcie_replay", smi.amdsmi_get_gpu_pci_replay_counter, h)
        values["pcie_replay_count"] = None if _num(replay) is None else int(replay)

        if errors:
            extra["read_errors"] = float(len(errors))
            log.debug("GPU %d: fields failed: %s", gpu, errors)
        clean = {k: v for k, v in values.items() if v is not None}
        return TelemetrySample(
            cluster=self.cluster, node=self.node, gpu=gpu, backend="amdsmi", extra=extra, **clean
        )

    def _open_reader(self) -> None:
        smi = self.smi
        self._reader_done = True
        etypes = getattr(smi, "AmdSmiEvtNotificationType", None)
        if etypes is None or not hasattr(smi, "AmdSmiEventReader") or not self._handles:
            return
        wanted = [getattr(etypes, n) for n in _EVENT_TYPES if hasattr(etypes, n)]
        try:
            # One reader per GPU is what the library offers; the agent's thread polls each.
            self._reader = [smi.AmdSmiEventReader(h, wanted) for h in self._handles]
        except smi.AmdSmiException as exc:
            log.warning("AMD SMI event reader unavailable (%s); polling only", exc)

    def wait_events(self, timeout_s: float) -> list[TelemetrySample]:
        """Read critical events (reset, ring hang, VM fault) from ``AmdSmiEventReader``."""
        if not self._reader_done:
            self._open_reader()
        if not self._reader or self._closed:
            threading.Event().wait(timeout_s)
            return []
        per_reader_ms = max(1, int(timeout_s * 1000 / len(self._reader)))
        out: list[TelemetrySample] = []
        for gpu, reader in enumerate(self._reader):
            try:
                events = reader.read(per_reader_ms)
            except self.smi.AmdSmiException:
                continue  # a timeout is reported as an exception by some versions
            for ev in events or []:
                name = str(ev.get("event", "")).upper()
                msg = str(ev.get("message", ""))[:200]
                fields: dict[str, Any] = {}
                if "RESET" in name or "RING_HANG" in name:
                    fields["xid"] = XID_FIRMWARE_HANG
                elif "VMFAULT" in name:
                    fields["xid"] = 31  # a page fault of the application, as NVIDIA's XID 31
                elif "THERMAL" in name:
                    fields["hw_thermal_slowdown"] = True
                    fields["hw_slowdown"] = True
                else:
                    continue
                log.info("GPU %d event %s: %s", gpu, name, msg)
                out.append(
                    TelemetrySample(
                        cluster=self.cluster, node=self.node, gpu=gpu, backend="amdsmi", **fields
                    )
                )
        return out

    def close(self) -> None:
        """Stop the event readers and shut AMD SMI down."""
        if self._closed:
            return
        self._closed = True
        for reader in self._reader or []:
            try:
                reader.stop()
            except self.smi.AmdSmiException as exc:
                log.debug("event reader stop: %s", exc)
        try:
            self.smi.amdsmi_shut_down()
        except self.smi.AmdSmiException as exc:
            log.debug("amdsmi_shut_down: %s", exc)


__all__ = ["AmdSmiBackend"]
