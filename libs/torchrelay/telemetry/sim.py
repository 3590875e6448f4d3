"""A simulated GPU node: healthy telemetry plus scripted and live-injected faults.

Used by the tests, the demo and the benchmarks, and by ``torchrelay chaos`` on simulated
slots. A *scenario* is a list of timed signals (YAML or JSON)::

    gpus: 4                      # GPUs per node (default 8)
    events:
      - at: 2.0                  # seconds after the backend started
        node: local-0            # optional: only this node ("*" or absent: every node)
        gpu: 0
        signal: xid              # xid | ecc | thermal | remap | nvlink | slow | lost | set
        code: 79                 #   | rate | clear
      - {at: 5, gpu: 1, signal: thermal, duration: 600}
      - {at: 5, gpu: 2, signal: set, fields: {temperature_c: 91}}
      - {at: 9, gpu: 3, signal: rate, fields: {pcie_replay_count: 0.5}}  # +0.5 per second
      - {at: 60, gpu: 1, signal: clear}

Signals:
    xid: a critical event with XID ``code`` (default 79). XID 79 also leaves the GPU lost
        (``gpu_lost`` on every poll) for ``duration`` seconds (default: until cleared).
    ecc: one double-bit (uncorrectable) ECC error: the volatile and aggregate uncorrected
        counters go up and a critical event (XID 48) is delivered.
    thermal: hardware thermal slowdown (clock-event reasons HW_SLOWDOWN|HW_THERMAL) with the
        temperature at the slowdown threshold, for ``duration`` (default 600 s).
    remap: a row remap pending (and one more uncorrectable remapped row), until cleared.
    nvlink: one NVLink recovery error and a link down for ``duration`` (default 60 s), with
        a critical event (XID 74).
    slow: a straggler. The sample carries ``extra["slow_factor"] = factor`` (default 1.5)
        for ``duration`` (default: until cleared). The detector does not flag a straggler
        from this value; it flags stragglers from step times. A training process on a
        simulated slot that wants to *be* slow reads ``slow_factor`` from its node's
        telemetry (``tr.tel.<cluster>.<node>``, its ``gpu``) and stretches each step by it.
    lost: the GPU falls off the bus (``gpu_lost``) for ``duration`` (default: until cleared).
    set: override sample fields (``fields``) for ``duration`` (default: until cleared).
    rate: grow counters by ``fields[name]`` per second while active.
    clear: remove every lasting effect on the GPU.

Live injection (:meth:`SimBackend.inject`) takes a :class:`ChaosRequest`, the body of the
``tr.ctl.chaos.<cluster>.<node>`` request that ``torchrelay chaos`` sends.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from torchrelay.contract import TelemetrySample

Signal = Literal["xid", "ecc", "thermal", "remap", "nvlink", "slow", "lost", "set", "rate", "clear"]

_COUNTERS = (
    "ecc_volatile_corrected",
    "ecc_volatile_uncorrected",
    "ecc_aggregate_corrected",
    "ecc_aggregate_uncorrected",
    "retired_pages",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
    "nvlink_crc_errors",
    "nvlink_replay_errors",
    "nvlink_recovery_errors",
    "pcie_replay_count",
)


class ChaosRequest(BaseModel):
    """A live fault for a node agent's simulator (request body on ``Subjects.chaos``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    fault: Literal["xid", "ecc", "thermal", "remap", "nvlink", "slow", "lost", "clear"]
    gpu: int = Field(default=0, ge=0, le=1023)
    code: int | None = None
    factor: float | None = Field(default=None, gt=0)
    duration: float | None = Field(default=None, gt=0)


class ScenarioEvent(BaseModel):
    """One timed signal of a scenario (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    at: float = Field(ge=0)
    signal: Signal
    gpu: int = Field(default=0, ge=0, le=1023)
    node: str | None = None
    code: int | None = None
    factor: float | None = Field(default=None, gt=0)
    duration: float | None = Field(default=None, gt=0)
    fields: dict[str, Any] = Field(default_factory=dict)


class Scenario(BaseModel):
    """A scripted sequence of signals for simulated nodes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    gpus: int = Field(default=8, ge=0, le=1024)
    events: list[ScenarioEvent] = Field(default_factory=list)

    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        """Read a scenario from a YAML or JSON file (errors name the file and the field)."""
        text = Path(path).read_text()
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
        return cls.model_validate(data or {})


@dataclass
class _Effect:
    signal: str
    until: float | None
    fields: dict[str, Any] = field(default_factory=dict)
    factor: float | None = None


@dataclass
class _SimGpu:
    index: int
    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0.0))
    effects: list[_Effect] = field(default_factory=list)


class SimBackend:
    """A node of simulated GPUs.

    Args:
        cluster: cluster name stamped on samples.
        node: this node's name (scenario events naming another node are ignored).
        gpus: GPUs per node (a scenario's ``gpus`` wins when given).
        scenario: scripted signals, or None for a healthy node.
        clock: seconds, monotonic (tests pass a fake clock).
        seed: seed of the small noise on temperature and power.
    """

    name = "sim"

    def __init__(
        self,
        cluster: str,
        node: str,
        gpus: int = 8,
        scenario: Scenario | None = None,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
    ) -> None:
        self.cluster = cluster
        self.node = node
        self._clock = clock
        self._t0 = clock()
        count = scenario.gpus if scenario is not None else gpus
        self._gpus = [_SimGpu(i) for i in range(count)]
        self._pending = sorted(
            (e for e in (scenario.events if scenario else []) if e.node in (None, "*", node)),
            key=lambda e: e.at,
        )
        self._events: list[TelemetrySample] = []
        self._cond = threading.Condition()
        self._rng = random.Random(seed)
        self._last_read = self._t0
        self._closed = False

    # ----------------------------------------------------------------- injection

    def inject(self, request: ChaosRequest) -> dict[str, Any]:
        """Apply a live fault now; returns what was done (the chaos request's reply)."""
        ev = ScenarioEvent(
            at=0,
            signal=request.fault,
            gpu=request.gpu,
            code=request.code,
            factor=request.factor,
            duration=request.duration,
        )
        with self._cond:
            self._apply(ev, self._clock())
        return {
            "node": self.node,
            "gpu": request.gpu,
            "fault": request.fault,
            "code": request.code,
            "factor": request.factor,
            "duration": request.duration,
        }

    def _gpu(self, index: int) -> _SimGpu:
        if index >= len(self._gpus):
            raise ValueError(
                f"GPU {index} does not exist on simulated node {self.node} ({len(self._gpus)} GPUs)"
            )
        return self._gpus[index]

    def _queue_event(self, gpu: int, **fields: Any) -> None:
        self._events.append(
            TelemetrySample(
                cluster=self.cluster,
                node=self.node,
                gpu=gpu,
                backend="sim",
                gpu_model="sim-gpu",
                **fields,
            )
        )
        self._cond.notify_all()

    def _apply(self, ev: ScenarioEvent, now: float) -> None:
        g = self._gpu(ev.gpu)

        def until(default: float | None) -> float | None:
            d = ev.duration if ev.duration is not None else default
            return None if d is None else now + d

        if ev.signal == "xid":
            code = ev.code if ev.code is not None else 79
            self._queue_event(ev.gpu, xid=code)
            if code == 79:
                g.effects.append(_Effect("lost", until(None), {"gpu_lost": True}))
        elif ev.signal == "ecc":
            for key in ("ecc_volatile_uncorrected", "ecc_aggregate_uncorrected"):
                g.counters[key] += 1
            self._queue_event(
                ev.gpu, xid=48, ecc_volatile_uncorrected=int(g.counters["ecc_volatile_uncorrected"])
            )
        elif ev.signal == "thermal":
            g.effects.append(
                _Effect(
                    "thermal",
                    until(600.0),
                    {
                        "hw_slowdown": True,
                        "hw_thermal_slowdown": True,
                        "clock_event_reasons": 0x48,
                        "temperature_c": 87.0,
                    },
                )
            )
        elif ev.signal == "remap":
            g.counters["remapped_rows_uncorrectable"] += 1
            g.effects.append(_Effect("remap", until(None), {"remap_pending": True}))
        elif ev.signal == "nvlink":
            g.counters["nvlink_recovery_errors"] += 1
            g.effects.append(_Effect("nvlink", until(60.0), {"nvlink_down_links": 1}))
            self._queue_event(ev.gpu, xid=74)
        elif ev.signal == "slow":
            g.effects.append(_Effect("slow", until(None), factor=ev.factor or 1.5))
        elif ev.signal == "lost":
            g.effects.append(_Effect("lost", until(None), {"gpu_lost": True}))
        elif ev.signal == "set":
            g.effects.append(_Effect("set", until(None), dict(ev.fields)))
        elif ev.signal == "rate":
            g.effects.append(_Effect("rate", until(None), dict(ev.fields)))
        elif ev.signal == "clear":
            g.effects.clear()

    # ----------------------------------------------------------------- backend interface

    def gpu_count(self) -> int:
        """GPUs of this simulated node."""
        return len(self._gpus)

    def _advance(self, now: float) -> None:
        rel = now - self._t0
        while self._pending and self._pending[0].at <= rel:
            ev = self._pending.pop(0)
            if ev.gpu < len(self._gpus):
                self._apply(ev, self._t0 + ev.at)
        elapsed = max(0.0, now - self._last_read)
        self._last_read = now
        for g in self._gpus:
            g.effects = [e for e in g.effects if e.until is None or e.until > now]
            for e in g.effects:
                if e.signal == "rate":
                    for key, per_s in e.fields.items():
                        if key in g.counters:
                            g.counters[key] += float(per_s) * elapsed

    def read(self) -> list[TelemetrySample]:
        """One sample per simulated GPU, with the effects active now."""
        with self._cond:
            self._advance(self._clock())
            return [self._sample(g) for g in self._gpus]

    def _sample(self, g: _SimGpu) -> TelemetrySample:
        values: dict[str, Any] = {
            "gpu_model": "sim-gpu",
            "temperature_c": round(55.0 + g.index + self._rng.uniform(-1.0, 1.0), 1),
            "temp_slowdown_c": 87.0,
            "temp_shutdown_c": 92.0,
            "memory_temperature_c": round(60.0 + self._rng.uniform(-1.0, 1.0), 1),
            "power_w": round(300.0 + self._rng.uniform(-20.0, 20.0), 1),
            "power_limit_w": 700.0,
            "clock_event_reasons": 0,
            "hw_slowdown": False,
            "hw_thermal_slowdown": False,
            "sw_thermal_slowdown": False,
            "remap_pending": False,
            "remap_failure": False,
            "unrepairable_memory": False,
            "nvlink_down_links": 0,
            "recovery_action": 0,
        }
        values.update({k: int(v) for k, v in g.counters.items()})
        extra: dict[str, float] = {}
        for e in g.effects:
            if e.signal == "slow" and e.factor is not None:
                extra["slow_factor"] = e.factor
            elif e.signal != "rate":
                values.update(e.fields)
        return TelemetrySample(
            cluster=self.cluster, node=self.node, gpu=g.index, backend="sim", extra=extra, **values
        )

    def wait_events(self, timeout_s: float) -> list[TelemetrySample]:
        """Critical events (XID, ECC, NVLink) as soon as they are injected or scheduled."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._events and not self._closed:
                # Scripted events fall due with time: advance the script while waiting.
                self._advance(self._clock())
                if self._events:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(min(left, 0.05))
            events, self._events = self._events, []
            return events

    def close(self) -> None:
        """Wake a waiting event thread; idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


__all__ = ["ChaosRequest", "Scenario", "ScenarioEvent", "SimBackend"]
