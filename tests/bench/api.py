"""Portal API benchmark: latency of ``GET /v1/incidents`` under 200 concurrent clients.

What runs: a real ``nats-server`` and ``redis-server``; the real scheduler service
(``python -m services.scheduler``) holding ``INCIDENTS`` incidents made the production way
(jobs registered and faults published on the bus); the API as its own process
(``python -m services.api``, uvicorn, default settings: answers of identical list queries
kept ``TORCHRELAY_LIST_CACHE_S`` = 1 s); and, in this process, 200 clients, each with its own
keep-alive HTTP/1.1 connection, using the operator token. The clients are a bare asyncio
protocol (:class:`_Keepalive`), not httpx: 200 httpx clients used more CPU than the API and,
on this 2-core machine, set the latency themselves.

Two loads, each over 200 concurrent clients asking for one page of 50 incidents:

- ``closed`` (the strict reading, the headline): every client sends its next request as soon
  as the previous one is answered, for ``BENCH_API_CLOSED_S`` (10) seconds. Latency here is
  clients / throughput (Little's law): p99 < 50 ms would need more than 4,000 answers/s.
- ``portal``: every client asks once a second (with jitter), as dashboards and portals poll:
  ~200 requests/s offered, ``BENCH_API_ROUNDS`` (15) rounds.

Each load runs with the real scheduler behind the API (the headline) and with a real-NATS
responder process answering ``scheduler.incident_list`` from memory. Besides the latencies
the result gives the API process's CPU per request and its share of one core, and the load
generator's share (it runs in this process, on the same cores as the API).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, cast

import httpx

from services.api.settings import ApiSettings
from torchrelay.bus import Bus
from torchrelay.contract import (
    FaultAction,
    FaultDetected,
    FaultKind,
    JobRegistered,
    Member,
    Role,
    Severity,
    Subjects,
    make_event_id,
)
from torchrelay.runtime import free_port, nats_server, redis_server

CLIENTS = int(os.environ.get("BENCH_API_CLIENTS", "200"))
PORTAL_ROUNDS = int(os.environ.get("BENCH_API_ROUNDS", "15"))
CLOSED_S = float(os.environ.get("BENCH_API_CLOSED_S", "10"))
WARMUP_S = 2.0
JOBS = 100
INCIDENTS = 2 * JOBS
PAGE = 50
TARGET_P99_MS = 50.0
TOKEN = "trdev_bench-operator-token-0123456789abcdef"


def _percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def _summary(samples_s: list[float], errors: int, wall_s: float) -> dict[str, float]:
    ordered = sorted(s * 1000 for s in samples_s)
    return {
        "requests": len(ordered),
        "errors": errors,
        "p50_ms": round(_percentile(ordered, 0.50), 2),
        "p90_ms": round(_percentile(ordered, 0.90), 2),
        "p99_ms": round(_percentile(ordered, 0.99), 2),
        "max_ms": round(ordered[-1], 2) if ordered else float("nan"),
        "throughput_rps": round(len(ordered) / wall_s, 1) if wall_s else 0.0,
    }


def _spawn(module: str, env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=log.open("wb"),
    )


def _incident(i: int) -> dict[str, Any]:
    return {
        "incident_id": f"inc-{i:04d}",
        "tenant": f"tenant-{i % 10}",
        "job_id": f"job-{i // 2:03d}",
        "rank": i % 2,
        "node": f"node-{i % 16}",
        "gpu": i % 2,
        "fault_kind": "worker_lost",
        "severity": "fatal",
        "detected_at": "2026-11-01T00:00:00+00:00",
        "resolved_at": None,
        "resolution": "open",
        "stall_ms": None,
        "lost_steps": None,
        "bytes_moved": None,
        "generation_before": 1,
        "generation_after": None,
        "cluster": "local",
    }


async def _responder(nats_url: str) -> None:
    """A real-NATS ``scheduler.incident_list`` answering canned pages (``--responder``)."""
    incidents = [_incident(i) for i in range(INCIDENTS)]

    async def incident_list(body: dict[str, Any]) -> Any:
        start = int(body.get("cursor") or 0)
        end = start + int(body.get("limit", 100))
        return {
            "items": incidents[start:end],
            "next_cursor": str(end) if end < len(incidents) else None,
        }

    bus = await Bus.connect(nats_url, "bench-responder")
    await bus.serve("scheduler", "incident_list", incident_list)
    await bus.nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_per_request(pid: int, before: float, figures: dict[str, Any]) -> float:
    """The API process's CPU milliseconds per answered request: its cost on any machine,
    where latency on a shared machine also measures the neighbours."""
    done = int(figures["requests"]) + int(figures["errors"])
    return round((_cpu_s(pid) - before) * 1000 / done, 2) if done else float("nan")


def _cpu_pressure() -> float | None:
    """The share of the last 10 s in which some runnable task waited for a CPU (Linux PSI,
    ``/proc/pressure/cpu``), in percent; None where the kernel does not report it."""
    try:
        first = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = dict(f.split("=", 1) for f in first.split()[1:])
    return float(fields["avg10"]) if "avg10" in fields else None


def _wait_http(url: str, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {deadline_s:.0f}s")


async def _seed(nats_url: str) -> None:
    """Register JOBS jobs of 2 ranks and publish a worker_lost fault for each rank."""
    bus = await Bus.connect(nats_url, "bench-seed")
    try:
        for j in range(JOBS):
            job_id, tenant = f"job-{j:03d}", f"tenant-{j % 10}"
            await bus.publish(
                JobRegistered(
                    event_id=make_event_id("bench-reg", job_id),
                    source="bench",
                    job_id=job_id,
                    tenant=tenant,
                    world_size=2,
                    spares=1,
                    launcher_id=f"l-{job_id}",
                    members=[
                        Member(
                            member_id=f"{job_id}-m{r}",
                            role=Role.WORKER,
                            node=f"node-{j % 16}",
                            gpu=r,
                        )
                        for r in range(2)
                    ],
                ),
                Subjects.JOB_REGISTERED,
            )
        for j in range(JOBS):
            job_id = f"job-{j:03d}"
            for r in range(2):
                await bus.publish(
                    FaultDetected(
                        event_id=make_event_id("bench-fault", job_id, r),
                        source="bench",
                        fault_id=f"f-{job_id}-{r}",
                        cluster="local",
                        node=f"node-{j % 16}",
                        gpu=r,
                        job_id=job_id,
                        rank=r,
                        member_id=f"{job_id}-m{r}",
                        kind=FaultKind.WORKER_LOST,
                        severity=Severity.FATAL,
                        action=FaultAction.MIGRATE_NOW,
                    ),
                    Subjects.FAULT_DETECTED,
                )
    finally:
        await bus.close()


class _Keepalive(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection sending one prepared GET at a time.

    A load generator that costs little CPU: it shares the 2 cores with the API, so every
    microsecond it spends is taken from the API and counted as the API's latency. httpx spent
    more CPU per request than the API; asyncio streams (``readuntil``/``readexactly``, two
    wakeups per answer) about as much as the API's kept answer. This is a bare protocol:
    bytes in, one future completed per answer. The answer is checked (status 200 and a page
    of PAGE incidents) without parsing the JSON.
    """

    def __init__(self, host: str, port: int, request: bytes) -> None:
        self.host, self.port, self.request = host, port, request
        self.transport: asyncio.Transport | None = None
        self.received = bytearray()
        self.answer_end = -1  # where the answer being received ends, once its head is in
        self.waiter: asyncio.Future[bytes] | None = None

    async def get(self) -> tuple[bool, str]:
        loop = asyncio.get_running_loop()
        if self.transport is None:
            await loop.create_connection(lambda: self, self.host, self.port)
        assert self.transport is not None
        self.waiter = loop.create_future()
        self.transport.write(self.request)
        answer = await self.waiter
        head_end = answer.index(b"\r\n\r\n") + 4
        status = answer[9:12]
        body = answer[head_end:]
        if status != b"200" or body.count(b'"incident_id"') != PAGE:
            return False, f"{status.decode()} {body[:300].decode(errors='replace')}"
        return True, ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received += data
        if self.answer_end < 0:
            head_end = self.received.find(b"\r\n\r\n")
            if head_end < 0:
                return
            length = 0
            for line in bytes(self.received[:head_end]).lower().split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line[15:])
            self.answer_end = head_end + 4 + length
        if len(self.received) >= self.answer_end and self.waiter is not None:
            answer = bytes(self.received[: self.answer_end])
            del self.received[: self.answer_end]
            self.answer_end = -1
            if not self.waiter.done():
                self.waiter.set_result(answer)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"the API closed the connection: {exc}"))

    async def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def _load(url: str, mode: str) -> dict[str, Any]:
    """``CLIENTS`` clients on their own connections; ``mode`` "closed" (each asks again as
    soon as it has its answer, for ``CLOSED_S``) or "paced" (once a second, ``PORTAL_ROUNDS``
    times)."""
    samples: list[float] = []
    errors = 0
    first_errors: list[str] = []
    parsed = httpx.URL(url)
    host, port = parsed.host, int(parsed.port or 80)
    request = (
        f"GET /v1/incidents?limit={PAGE} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {TOKEN}\r\nAccept: application/json\r\n\r\n"
    ).encode()
    paced = mode == "paced"
    stop_at = time.monotonic() + (WARMUP_S if mode == "warmup" else CLOSED_S)

    async def client(i: int) -> None:
        nonlocal errors
        conn = _Keepalive(host, port, request)
        rng = random.Random(i)
        try:
            if paced:
                await asyncio.sleep(rng.random())  # spread the clients over the first second
            rounds = 0
            while (rounds < PORTAL_ROUNDS) if paced else (time.monotonic() < stop_at):
                started = time.perf_counter()
                try:
                    ok, why = await conn.get()
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    ok, why = False, repr(exc)
                    await conn.close()
                    conn = _Keepalive(host, port, request)
                elapsed = time.perf_counter() - started
                if ok:
                    samples.append(elapsed)
                else:
                    errors += 1
                    if len(first_errors) < 3:
                        first_errors.append(why)
                rounds += 1
                if paced:
                    await asyncio.sleep(max(0.0, rng.uniform(0.9, 1.1) - elapsed))
        finally:
            await conn.close()

    started = time.monotonic()
    cpu = time.process_time()
    await asyncio.gather(*(client(i) for i in range(CLIENTS)))
    wall = time.monotonic() - started
    summary: dict[str, Any] = {**_summary(samples, errors, wall)}
    # The load generator runs in this process, on the same cores as the API.
    summary["load_generator_cpu_share"] = round((time.process_time() - cpu) / wall, 3)
    if first_errors:
        summary["first_errors"] = first_errors
    return summary


def _run_clients(load: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """Run the clients on uvloop's event loop when it is installed (a dependency of the API:
    a cheaper generator leaves more of the shared cores to the API), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(load)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(load)


def _measure(behind: str) -> dict[str, Any]:
    """Start servers, the thing ``behind`` the API (``scheduler`` or ``responder``), the API;
    return both loads' figures."""
    with tempfile.TemporaryDirectory(prefix="tr-bench-api-") as tmp:
        root = Path(tmp)
        nats, redis = nats_server(root / "nats"), redis_server(root / "redis")
        nats.start()
        redis.start()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRELAY_")}
            env.update(
                {
                    "NATS_URL": nats.url,
                    "REDIS_URL": redis.url,
                    "TORCHRELAY_LOG_LEVEL": "WARNING",
                    "TORCHRELAY_ENVIRONMENT": "development",
                    "TORCHRELAY_OPERATOR_TOKEN": TOKEN,
                }
            )
            api_port = free_port()
            if behind == "scheduler":
                sched_port = free_port()
                procs.append(
                    _spawn(
                        "services.scheduler",
                        dict(env, TORCHRELAY_HTTP_PORT=str(sched_port)),
                        root / "scheduler.log",
                    )
                )
                _wait_http(f"http://127.0.0.1:{sched_port}/readyz")
            else:
                responder = _spawn(
                    "tests.bench.api", env, root / "responder.log", "--responder", nats.url
                )
                procs.append(responder)
                assert responder.stdout is not None
                if responder.stdout.readline().strip() != b"ready":
                    raise RuntimeError("the canned responder did not start")
            procs.append(
                _spawn(
                    "services.api", dict(env, TORCHRELAY_HTTP_PORT=str(api_port)), root / "api.log"
                )
            )
            url = f"http://127.0.0.1:{api_port}"
            _wait_http(f"{url}/readyz")
            if behind == "scheduler":
                asyncio.run(_seed(nats.url))
            end = time.monotonic() + 120
            count = 0
            while time.monotonic() < end:
                page = httpx.get(
                    f"{url}/v1/incidents",
                    params={"limit": 500},
                    timeout=30,
                    headers={"Authorization": f"Bearer {TOKEN}"},
                ).json()
                count = len(page["items"])
                if count >= INCIDENTS:
                    break
                time.sleep(0.2)
            if count < INCIDENTS:
                raise RuntimeError(f"{behind} holds {count} of {INCIDENTS} incidents")
            api_pid = procs[-1].pid
            _run_clients(_load(url, "warmup"))  # connections, caches
            # The load generator's own garbage collections would stall all 200 clients at
            # once and be counted as the API's latency: keep this process's startup heap
            # (httpx, pydantic, the contract) out of them, as the API does with its own.
            gc.collect()
            gc.freeze()
            cpu, t0 = _cpu_s(api_pid), time.monotonic()
            closed = _run_clients(_load(url, "closed"))
            closed["cpu_pressure_avg10"] = _cpu_pressure()
            closed["api_cpu_ms_per_request"] = _cpu_per_request(api_pid, cpu, closed)
            closed["api_cpu_share"] = round((_cpu_s(api_pid) - cpu) / (time.monotonic() - t0), 3)
            cpu, t0 = _cpu_s(api_pid), time.monotonic()
            portal = _run_clients(_load(url, "paced"))
            portal["api_cpu_ms_per_request"] = _cpu_per_request(api_pid, cpu, portal)
            portal["api_cpu_share"] = round((_cpu_s(api_pid) - cpu) / (time.monotonic() - t0), 3)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            nats.stop()
            redis.stop()
    return {
        "closed_loop": {**closed, "duration_s": CLOSED_S},
        "portal": {**portal, "offered_rps_per_client": 1.0, "rounds": PORTAL_ROUNDS},
    }


def run() -> dict[str, Any]:
    """Measure the API with the real scheduler behind it, then with a canned responder."""
    scheduler = _measure("scheduler")
    responder = _measure("responder")
    strict = scheduler["closed_loop"]
    result: dict[str, Any] = {
        "route": f"GET /v1/incidents?limit={PAGE}",
        "clients": CLIENTS,
        "load": f"{CLIENTS} closed-loop clients (each sends its next request when the previous "
        f"one is answered), {CLOSED_S:.0f} s, real scheduler behind the API",
        "list_cache_s": ApiSettings.model_fields["list_cache_s"].default,
        "with_scheduler": {
            "behind_the_api": f"the real scheduler process holding {INCIDENTS} incidents in Redis",
            **scheduler,
        },
        "with_responder": {
            "behind_the_api": "a real-NATS responder process answering "
            "scheduler.incident_list from memory",
            **responder,
        },
        "p50_ms": strict["p50_ms"],
        "p99_ms": strict["p99_ms"],
        "throughput_rps": strict["throughput_rps"],
        "errors": strict["errors"],
        "p50_ms_portal": scheduler["portal"]["p50_ms"],
        "p99_ms_portal": scheduler["portal"]["p99_ms"],
        "api_cpu_ms_per_request": strict["api_cpu_ms_per_request"],
        "load_generator": "in the bench process, on the same cores as the API "
        f"({strict['load_generator_cpu_share']:.0%} of one core during the closed loop)",
        "target_p99_ms": TARGET_P99_MS,
        "target_met": strict["p99_ms"] < TARGET_P99_MS and strict["errors"] == 0,
        # Latency on a shared machine measures the neighbours too: say how busy it was.
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        # How contended the CPUs were over the headline closed loop (PSI "some", 10 s).
        "cpu_pressure_avg10_after_closed_loop": strict.get("cpu_pressure_avg10"),
        "cpu_cores": os.cpu_count(),
    }
    result["summary"] = (
        f"{CLIENTS} closed-loop clients: p50 {result['p50_ms']} ms p99 {result['p99_ms']} ms, "
        f"{result['throughput_rps']} req/s (target p99 < {TARGET_P99_MS:.0f} ms: "
        f"{'met' if result['target_met'] else 'NOT met'}); polling 1/s: p99 "
        f"{result['p99_ms_portal']} ms"
    )
    print(
        f"GET /v1/incidents (page of {PAGE}), {CLIENTS} concurrent clients; 'closed' = each "
        "client asks again as soon as it is answered, 'portal' = each asks once a second"
    )
    print(
        f"{'behind the API':<16}{'load':<8}{'requests':>9}{'errors':>7}{'p50 ms':>9}"
        f"{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}{'req/s':>8}{'API ms/req':>11}"
        f"{'API cpu':>8}{'gen cpu':>8}"
    )
    for behind, figures in (("real scheduler", scheduler), ("responder", responder)):
        for name, key in (("closed", "closed_loop"), ("portal", "portal")):
            row = figures[key]
            print(
                f"{behind:<16}{name:<8}{row['requests']:>9}{row['errors']:>7}"
                f"{row['p50_ms']:>9}{row['p90_ms']:>9}{row['p99_ms']:>9}{row['max_ms']:>9}"
                f"{row['throughput_rps']:>8}{row['api_cpu_ms_per_request']:>11}"
                f"{row['api_cpu_share']:>8.0%}{row['load_generator_cpu_share']:>8.0%}"
            )
    pressure = result["cpu_pressure_avg10_after_closed_loop"]
    print(
        f"load average {result['load_average_1m_at_end']} on {result['cpu_cores']} cores"
        + (
            f" (CPU pressure over the closed loop: some task waited for a CPU {pressure}% "
            "of the time)"
            if pressure is not None
            else ""
        )
        + "; "
        f"'API cpu' and 'gen cpu' are the API process's and the load generator's share of one "
        f"core; the load generator runs in this process. {result['summary']}"
    )
    return result


if __name__ == "__main__":  # pragma: no cover
    if sys.argv[1:2] == ["--responder"]:
        asyncio.run(_responder(sys.argv[2]))
    else:
        print(json.dumps(run(), indent=2))
