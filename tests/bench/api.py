"""Portal API benchmark: latency of ``GET /v1/incidents`` under 200 concurrent clients.

What runs: a real ``nats-server`` and ``redis-server``; the real scheduler service
(``python -m services.scheduler``) holding ``INCIDENTS`` incidents made the production way
(jobs registered and faults published on the bus); the API as its own process
(``python -m services.api``, uvicorn); and, in this process, 200 ``httpx.AsyncClient``
clients, each with its own keep-alive connection, using the operator token (a token check
is the same cached HMAC for both scopes).

Two loads, each over 200 concurrent clients asking for one page of 50 incidents:

- ``portal``: every client asks once a second (with jitter), as dashboards and portals poll:
  ~200 requests/s offered. The target (p99 < 50 ms) is judged on this load.
- ``saturation``: every client asks again as soon as it has its answer, to find the
  throughput ceiling; here latency is ~clients / throughput by Little's law, so it is
  reported but not held to the target.

Each load runs twice: with a real-NATS responder process answering
``scheduler.incident_list`` from memory (the API's own cost: HTTP, auth, validation, the NATS
round trip; the target is judged on this one), and with the real scheduler process behind it
(what an operator sees end to end, including the scheduler's Redis reads).

Everything shares this machine's cores (the client too), so the figures are conservative.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

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
SATURATION_S = 10.0
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


async def _load(url: str, paced: bool) -> dict[str, Any]:
    samples: list[float] = []
    errors = 0
    first_errors: list[str] = []
    stop_at = time.monotonic() + SATURATION_S
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async def client(i: int) -> None:
        nonlocal errors
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(
            base_url=url, headers=headers, limits=limits, timeout=30
        ) as http:
            rng = random.Random(i)
            if paced:
                await asyncio.sleep(rng.random())  # spread the clients over the first second
            rounds = 0
            while (rounds < PORTAL_ROUNDS) if paced else (time.monotonic() < stop_at):
                started = time.perf_counter()
                why = ""
                try:
                    r = await http.get("/v1/incidents", params={"limit": PAGE})
                    ok = r.status_code == 200 and len(r.json()["items"]) == PAGE
                    why = f"{r.status_code} {r.text[:300]}"
                except httpx.HTTPError as exc:
                    ok, why = False, repr(exc)
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

    started = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(CLIENTS)))
    summary: dict[str, Any] = {**_summary(samples, errors, time.monotonic() - started)}
    if first_errors:
        summary["first_errors"] = first_errors
    return summary


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
            asyncio.run(_load(url, paced=True))  # warm-up: connections and caches
            cpu = _cpu_s(api_pid)
            portal = asyncio.run(_load(url, paced=True))
            portal["api_cpu_ms_per_request"] = _cpu_per_request(api_pid, cpu, portal)
            cpu = _cpu_s(api_pid)
            saturation = asyncio.run(_load(url, paced=False))
            saturation["api_cpu_ms_per_request"] = _cpu_per_request(api_pid, cpu, saturation)
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
        "portal": {**portal, "offered_rps_per_client": 1.0, "rounds": PORTAL_ROUNDS},
        "saturation": {**saturation, "duration_s": SATURATION_S},
    }


def run() -> dict[str, Any]:
    """Measure the API with a canned responder, then with the real scheduler; print, return."""
    responder = _measure("responder")
    scheduler = _measure("scheduler")
    portal = responder["portal"]
    result: dict[str, Any] = {
        "route": f"GET /v1/incidents?limit={PAGE}",
        "clients": CLIENTS,
        "with_responder": {
            "behind_the_api": "a real-NATS responder process answering "
            "scheduler.incident_list from memory",
            **responder,
        },
        "with_scheduler": {
            "behind_the_api": f"the real scheduler process holding {INCIDENTS} incidents in Redis",
            **scheduler,
        },
        "p50_ms": portal["p50_ms"],
        "p99_ms": portal["p99_ms"],
        "p50_ms_real_scheduler": scheduler["portal"]["p50_ms"],
        "p99_ms_real_scheduler": scheduler["portal"]["p99_ms"],
        "api_cpu_ms_per_request": portal["api_cpu_ms_per_request"],
        "target_p99_ms": TARGET_P99_MS,
        "target_met": portal["p99_ms"] < TARGET_P99_MS and portal["errors"] == 0,
        # Latency on a shared machine measures the neighbours too: say how busy it was.
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "cpu_cores": os.cpu_count(),
    }
    print(
        f"GET /v1/incidents (page of {PAGE}), {CLIENTS} concurrent clients; 'portal' = each "
        "client asks once a second, 'saturation' = back to back"
    )
    print(
        f"{'behind the API':<16}{'load':<12}{'requests':>9}{'errors':>8}{'p50 ms':>9}"
        f"{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}{'req/s':>9}{'API cpu ms/req':>16}"
    )
    for behind, figures in (("responder", responder), ("real scheduler", scheduler)):
        for name in ("portal", "saturation"):
            row = figures[name]
            print(
                f"{behind:<16}{name:<12}{row['requests']:>9}{row['errors']:>8}"
                f"{row['p50_ms']:>9}{row['p90_ms']:>9}{row['p99_ms']:>9}{row['max_ms']:>9}"
                f"{row['throughput_rps']:>9}{row['api_cpu_ms_per_request']:>16}"
            )
    print(
        f"load average {result['load_average_1m_at_end']} on {result['cpu_cores']} cores; "
        f"target p99 < {TARGET_P99_MS:.0f} ms ({CLIENTS} clients polling once a second, responder "
        f"behind the API): {'met' if result['target_met'] else 'NOT met'}"
    )
    return result


if __name__ == "__main__":  # pragma: no cover
    if sys.argv[1:2] == ["--responder"]:
        asyncio.run(_responder(sys.argv[2]))
    else:
        print(json.dumps(run(), indent=2))
