"""Detector benchmark: telemetry samples per second one replica sustains, and fault latency.

The detector runs as its own process (``python -m services.detector``, one asyncio loop:
one core) against a real ``nats-server`` and ``redis-server``. This process plays 2,000
node agents of 8 GPUs each (one batch per node, as an agent publishes it).

1. capacity: telemetry is paced at rising rates (x1.25 per 3 s step); the highest rate after
   which the detector has evaluated everything within a second (its own counter,
   ``detector_samples_total`` on ``/metrics``) is what it sustains. The detector's CPU time
   (``/proc``) gives samples per CPU-second: what one core sustains even when the machine is
   shared (the wall-clock figure drops with the machine's load, which is printed).
2. latency at load: telemetry is offered at the target load (20,000 samples/s, a fixed rate,
   not as fast as the detector goes), then at 90% of the sustained rate (near saturation,
   where latency is mostly queueing), then with no telemetry at all, while an XID 79 is
   injected every 50 ms on a GPU not seen before, on the critical subject as the node agent
   sends it; latency = arrival of its ``FaultDetected`` at a subscriber in another process
   minus the XID sample's timestamp taken before it is published (same clock), p50 and p99.
   The headline is the figure at the target load; what one core sustains is phase 1's.
3. rules only: the same batches decoded and evaluated in-process without NATS (the ceiling
   of the pure rules path on this CPU).

Target (issue 4): 20,000 samples/s per core, p99 under 100 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from services.detector.rules import DetectorConfig, GpuWindows, evaluate_sample
from torchrelay.bus import Bus
from torchrelay.contract import Subjects, TelemetryBatch, TelemetrySample
from torchrelay.runtime import free_port, nats_server, redis_server

NODES = 2000
GPUS = 8
CLUSTER = "bench"
STEP_S = 3.0
MAX_RATE = 200_000.0
LATENCY_S = 6.0
PROBE_EVERY_S = 0.05
TARGET_SAMPLES_PER_S = 20_000
TARGET_P99_MS = 100.0


def _sample(node: str, gpu: int, ts: float, **fields: Any) -> TelemetrySample:
    return TelemetrySample(
        cluster=CLUSTER,
        node=node,
        gpu=gpu,
        backend="sim",
        ts=datetime.fromtimestamp(ts, UTC),
        gpu_model="H100",
        temperature_c=60.0 + gpu,
        temp_slowdown_c=87.0,
        temp_shutdown_c=92.0,
        memory_temperature_c=65.0,
        power_w=420.0,
        power_limit_w=700.0,
        ecc_volatile_corrected=3,
        ecc_volatile_uncorrected=0,
        ecc_aggregate_corrected=40,
        ecc_aggregate_uncorrected=0,
        remapped_rows_correctable=1,
        remapped_rows_uncorrectable=0,
        remap_pending=False,
        remap_failure=False,
        clock_event_reasons=0,
        hw_slowdown=False,
        hw_thermal_slowdown=False,
        nvlink_crc_errors=7,
        nvlink_replay_errors=0,
        nvlink_recovery_errors=0,
        nvlink_down_links=0,
        pcie_replay_count=2,
        recovery_action=0,
        **fields,
    )


def _batch(
    node: str, ts: float, *, critical: bool = False, samples: list[TelemetrySample] | None = None
) -> bytes:
    return (
        TelemetryBatch(
            event_id=f"b-{node}-{ts}",
            source=f"agent:{node}",
            cluster=CLUSTER,
            node=node,
            critical=critical,
            samples=samples if samples is not None else [_sample(node, g, ts) for g in range(GPUS)],
        )
        .model_dump_json()
        .encode()
    )


def _nodes() -> list[str]:
    return [f"n{i}" for i in range(NODES)]


def _rules_only(batches: list[bytes], seconds: float = 2.0) -> float:
    cfg = DetectorConfig()
    windows: dict[tuple[str, int], GpuWindows] = {}
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for raw in batches[:500]:
            batch = TelemetryBatch.model_validate_json(raw)
            for s in batch.samples:
                w = windows.get((s.node, s.gpu))
                if w is None:
                    w = windows[(s.node, s.gpu)] = GpuWindows(cfg)
                evaluate_sample(w, s, cfg)
            done += len(batch.samples)
    return done / (time.perf_counter() - start)


async def _samples_total(client: httpx.AsyncClient, port: int) -> float:
    text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    m = re.search(r"^detector_samples_total ([0-9.e+]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


async def _wait_ready(
    client: httpx.AsyncClient, port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"detector exited with {proc.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200:
                return
        await asyncio.sleep(0.2)
    raise RuntimeError("detector did not become ready within 60 s")


async def _drain(client: httpx.AsyncClient, port: int) -> float:
    """Wait until the detector's counter stops moving (its backlog is done)."""
    last = -1.0
    while True:
        now = await _samples_total(client, port)
        if now == last:
            return now
        last = now
        await asyncio.sleep(0.5)


async def _paced(bus: Bus, rate_samples_s: float, seconds: float) -> int:
    """Publish the node batches at ``rate_samples_s`` for ``seconds``; returns samples sent."""
    msgs_per_s = rate_samples_s / GPUS
    start = time.monotonic()
    sent = 0
    while (elapsed := time.monotonic() - start) < seconds:
        due = int(elapsed * msgs_per_s)
        while sent < due:
            k = sent % NODES
            await bus.nc.publish(_SUBJECTS[k], _BATCHES[k])
            sent += 1
        await bus.nc.flush()
        await asyncio.sleep(0.002)
    return sent * GPUS


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _sustains(
    bus: Bus, client: httpx.AsyncClient, port: int, pid: int, rate: float
) -> tuple[bool, float, float]:
    """Whether the detector evaluates ``rate`` samples/s without falling behind.

    It keeps up when, one second after a paced step ends, it has evaluated everything sent.
    Also returns the samples it evaluated and the CPU seconds it used meanwhile.
    """
    before, cpu0 = await _samples_total(client, port), _cpu_s(pid)
    sent = await _paced(bus, rate, STEP_S)
    deadline = time.monotonic() + 1.0
    ok = False
    while time.monotonic() < deadline:
        if await _samples_total(client, port) - before >= sent:
            ok = True
            break
        await asyncio.sleep(0.1)
    if not ok:
        await _drain(client, port)
    return ok, await _samples_total(client, port) - before, _cpu_s(pid) - cpu0


async def _capacity(
    bus: Bus, client: httpx.AsyncClient, port: int, pid: int
) -> tuple[float, float]:
    """The highest paced rate (steps of x1.25) the detector keeps up with, and its samples per
    CPU-second over all steps (what one core sustains, whatever else runs on the machine)."""
    for k in range(NODES):  # warm-up: every node and GPU known (a new node costs a write)
        await bus.nc.publish(_SUBJECTS[k], _BATCHES[k])
        if k % 50 == 0:
            await bus.nc.flush()
    await bus.nc.flush()
    await _drain(client, port)
    best = 0.0
    rate = 4000.0
    done = cpu = 0.0
    while rate <= MAX_RATE:
        ok, evaluated, used = await _sustains(bus, client, port, pid, rate)
        done += evaluated
        cpu += used
        print(
            f"  paced {rate:>8.0f} samples/s: {'kept up' if ok else 'fell behind'} "
            f"({evaluated / max(used, 1e-9):,.0f} samples per CPU-second)"
        )
        if not ok:
            break
        best = rate
        rate *= 1.25
    return best, done / max(cpu, 1e-9)


# A separate process timestamps the faults, so that this process's own publishing loop does
# not add to the latency it measures.
LISTENER = r"""
import asyncio, json, sys, time
import nats

async def main():
    nc = await nats.connect(sys.argv[1])

    async def on_fault(msg):
        t = time.time()
        d = json.loads(msg.data)
        sys.stdout.write(f"{d['node']} {d.get('gpu')} {t}\n")
        sys.stdout.flush()

    await nc.subscribe("tr.evt.fault.detected", cb=on_fault)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _start_listener(url: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", LISTENER, url], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("the fault listener did not start")
    return proc


def _arrivals(proc: subprocess.Popen[str]) -> dict[tuple[str, int], float]:
    proc.terminate()
    out, _ = proc.communicate(timeout=10)
    got: dict[tuple[str, int], float] = {}
    for line in out.splitlines():
        node, gpu, t = line.split()
        if gpu != "None":
            got.setdefault((node, int(gpu)), float(t))
    return got


async def _latency_at(
    bus: Bus, rate_samples_s: float
) -> tuple[dict[tuple[str, int], float], float]:
    """Pace telemetry at ``rate_samples_s`` and inject an XID every 50 ms on a new GPU;
    returns when each probe was sent and the load achieved."""
    global _PROBES
    msgs_per_s = rate_samples_s / GPUS
    sent_at: dict[tuple[str, int], float] = {}
    start = time.monotonic()
    next_probe = start
    probe = _PROBES
    sent = 0
    while (elapsed := time.monotonic() - start) < LATENCY_S:
        due = int(elapsed * msgs_per_s)
        ts = time.time()
        while sent < due:
            k = sent % NODES
            await bus.nc.publish(_SUBJECTS[k], _BATCHES[k])
            sent += 1
        if time.monotonic() >= next_probe:
            node, gpu = f"n{probe % NODES}", GPUS + probe // NODES
            at = time.time()
            sent_at[(node, gpu)] = at
            await bus.nc.publish(
                Subjects.telemetry_critical(CLUSTER, node),  # as the node agent publishes XIDs
                _batch(node, at, critical=True, samples=[_sample(node, gpu, at, xid=79)]),
            )
            probe += 1
            next_probe += PROBE_EVERY_S
        await bus.nc.flush()
        await asyncio.sleep(max(0.0, 0.005 - (time.time() - ts)))
    achieved = sent * GPUS / (time.monotonic() - start)
    _PROBES = probe
    return sent_at, achieved


def _latencies(
    sent_at: dict[tuple[str, int], float], arrivals: dict[tuple[str, int], float]
) -> list[float]:
    lat = [arrivals[k] - sent_at[k] for k in sent_at if k in arrivals]
    if len(lat) < len(sent_at):
        print(f"  {len(sent_at) - len(lat)} of {len(sent_at)} probe faults never arrived")
    return lat


_BATCHES: list[bytes] = []
_SUBJECTS: list[str] = []
_PROBES = 0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def _ms(values: list[float], q: float) -> float | None:
    return round(_pct(values, q) * 1000, 2) if values else None


async def _main() -> dict[str, Any]:
    now = time.time()
    _BATCHES[:] = [_batch(n, now) for n in _nodes()]
    _SUBJECTS[:] = [Subjects.telemetry(CLUSTER, n) for n in _nodes()]
    rules_only = _rules_only(_BATCHES)
    with tempfile.TemporaryDirectory(prefix="tr-bench-detector-") as tmp:
        nats = nats_server(Path(tmp) / "nats")
        redis = redis_server(Path(tmp) / "redis")
        nats.start()
        redis.start()
        port = free_port()
        env = {
            **os.environ,
            "NATS_URL": nats.url,
            "REDIS_URL": redis.url,
            "TORCHRELAY_HTTP_PORT": str(port),
            "TORCHRELAY_LOG_LEVEL": "ERROR",
            "TORCHRELAY_ENVIRONMENT": "test",
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.detector"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        bus = await Bus.connect(nats.url, "bench-detector")
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                await _wait_ready(client, port, proc)
                capacity, per_core = await _capacity(bus, client, port, proc.pid)
                base = capacity or 2000.0
                listener = _start_listener(nats.url)
                try:
                    sent_target, achieved = await _latency_at(bus, TARGET_SAMPLES_PER_S)
                    sent_full, achieved_full = await _latency_at(bus, 0.9 * base)
                    sent_idle, _ = await _latency_at(bus, 0.0)
                    await asyncio.sleep(2.0)  # the last probes' faults come in
                finally:
                    arrivals = _arrivals(listener)
                latencies = _latencies(sent_target, arrivals)
                full = _latencies(sent_full, arrivals)
                idle = _latencies(sent_idle, arrivals)
        finally:
            await bus.close()
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            nats.stop()
            redis.stop()
    return {
        "samples_per_s": round(capacity),
        "samples_per_cpu_s": round(per_core),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "rules_only_samples_per_s": round(rules_only),
        "latency_load_samples_per_s": round(achieved),
        "fault_latency_p50_ms": _ms(latencies, 0.50),
        "fault_latency_p99_ms": _ms(latencies, 0.99),
        "faults_measured": len(latencies),
        "near_saturation_load_samples_per_s": round(achieved_full),
        "fault_latency_near_saturation_p50_ms": _ms(full, 0.50),
        "fault_latency_near_saturation_p99_ms": _ms(full, 0.99),
        "fault_latency_idle_p50_ms": _ms(idle, 0.50),
        "fault_latency_idle_p99_ms": _ms(idle, 0.99),
        "nodes": NODES,
        "gpus_per_node": GPUS,
        "cpus": os.cpu_count(),
        "target_samples_per_s": TARGET_SAMPLES_PER_S,
        "target_p99_ms": TARGET_P99_MS,
    }


def run() -> dict[str, Any]:
    """Measure, print a small table, and return the figures."""
    r = asyncio.run(_main())
    rows = [
        (
            "samples/s sustained (NATS -> rules)",
            r["samples_per_s"],
            f"target {TARGET_SAMPLES_PER_S}",
        ),
        (
            "samples per CPU-second (one core)",
            r["samples_per_cpu_s"],
            f"target {TARGET_SAMPLES_PER_S}",
        ),
        ("samples/s rules only (decode+evaluate)", r["rules_only_samples_per_s"], ""),
        ("target load offered (samples/s)", r["latency_load_samples_per_s"], "fixed rate"),
        ("fault latency p50 (ms) at target load", r["fault_latency_p50_ms"], ""),
        (
            "fault latency p99 (ms) at target load",
            r["fault_latency_p99_ms"],
            f"target < {TARGET_P99_MS:g}",
        ),
        ("faults measured (at target load)", r["faults_measured"], ""),
        ("near saturation (samples/s)", r["near_saturation_load_samples_per_s"], "90% sustained"),
        ("near saturation: p50 (ms)", r["fault_latency_near_saturation_p50_ms"], "queueing"),
        ("near saturation: p99 (ms)", r["fault_latency_near_saturation_p99_ms"], "queueing"),
        ("no telemetry load: p50 (ms)", r["fault_latency_idle_p50_ms"], ""),
        ("no telemetry load: p99 (ms)", r["fault_latency_idle_p99_ms"], ""),
        ("machine load average (1 min)", r["load_average_1m"], f"{r['cpus']} CPUs"),
    ]
    print("detector benchmark (one replica, one process)")
    for name, value, note in rows:
        print(f"  {name:<42}{value!s:>10}   {note}")
    return r


if __name__ == "__main__":
    run()
