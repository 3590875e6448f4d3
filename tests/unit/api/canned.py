"""Real-NATS responders with canned, schema-valid answers for every verb the API asks.

They run on their own event loop in a thread, so synchronous callers (FastAPI's TestClient,
schemathesis, the CLI, headless Chromium) can block while the responders keep answering.
Each responder checks the request's keys as the real service does (``extra="forbid"``), so
the API cannot send a service something it would refuse.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import uvicorn

from torchrelay.bus import Bus, Conflict, NotFound, RequestInvalid
from torchrelay.goodput import (
    Assumptions,
    GenerationSpan,
    Goodput,
    IncidentFacts,
    JobFacts,
    job_goodput,
)

T = TypeVar("T")

OPERATOR_TOKEN = "trdev_unit-test-operator-token-0123456789"
NOW = datetime.now(UTC).replace(microsecond=0)


class BackgroundLoop:
    """An asyncio event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, daemon=True, name="canned-services"
        )
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run ``coro`` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _iso(delta_min: float) -> str:
    return (NOW - timedelta(minutes=delta_min)).isoformat()


def _incident(
    incident_id: str,
    tenant: str,
    job_id: str,
    minutes_ago: float,
    resolution: str = "migrated_live",
) -> dict[str, Any]:
    return {
        "incident_id": incident_id,
        "tenant": tenant,
        "job_id": job_id,
        "rank": 1,
        "node": "node-2",
        "gpu": 3,
        "fault_kind": "gpu_lost",
        "severity": "fatal",
        "detected_at": _iso(minutes_ago),
        "resolved_at": None if resolution == "open" else _iso(minutes_ago - 0.5),
        "resolution": resolution,
        "stall_ms": 57.0,
        "lost_steps": 1,
        "bytes_moved": 2048,
        "generation_before": 1,
        "generation_after": 2,
        "cluster": "local",
    }


def _job(job_id: str, tenant: str) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "tenant": tenant,
        "cluster": "local",
        "world_size": 2,
        "spares": 1,
        "generation": 2,
        "committed_step": 41,
        "state": "running",
        "policy": "wait",
        "ranks": [
            {"rank": 0, "node": "node-1", "gpu": 0, "pid": 100, "member_id": "m0"},
            {"rank": 1, "node": "node-1", "gpu": 1, "pid": None, "member_id": "m1"},
        ],
    }


def _contract(contract_id: str, tenant: str, ended: bool) -> dict[str, Any]:
    start = NOW - timedelta(days=60)
    end = NOW - timedelta(days=1) if ended else NOW + timedelta(days=300)
    return {
        "contract_id": contract_id,
        "tenant": tenant,
        "term_start": start.isoformat(),
        "term_end": end.isoformat(),
        "renewal_fee_minor": 1_000_000,
        "currency": "USD",
        "threshold": 0.9,
        "credit_rate": 0.25,
        "count_proactive": False,
    }


def _guarantee(contract: dict[str, Any], eligible: int, migrated: int) -> dict[str, Any]:
    ratio = migrated / eligible if eligible else 1.0
    met = ratio >= contract["threshold"]
    return {
        "contract_id": contract["contract_id"],
        "term_start": contract["term_start"],
        "term_end": contract["term_end"],
        "eligible_failures": eligible,
        "resolved_by_migration": migrated,
        "prevented_failures": 1,
        "ratio": ratio,
        "threshold": contract["threshold"],
        "met": met,
        "credit_minor": 0 if met else 250_000,
        "currency": "USD",
        "final": False,
    }


def _page(items: list[Any], body: dict[str, Any]) -> dict[str, Any]:
    cursor = body.get("cursor")
    if cursor is not None and not str(cursor).isdigit():
        raise RequestInvalid("cursor must be an offset this service returned", "cursor")
    start = int(cursor or 0)
    end = start + int(body.get("limit", 100))
    return {"items": items[start:end], "next_cursor": str(end) if end < len(items) else None}


def _only(body: dict[str, Any], *allowed: str) -> None:
    for key in body:
        if key not in allowed:
            raise RequestInvalid(f"{key}: extra inputs are not permitted", key)


class CannedServices:
    """Scheduler, billing, detector and spare-pool verbs answered from fixed data."""

    def __init__(self) -> None:
        self.jobs = [_job("job-a", "acme"), _job("job-b", "globex")]
        self.incidents = [
            _incident("inc-a1", "acme", "job-a", 30),
            _incident("inc-a2", "acme", "job-a", 90, "checkpoint_restart"),
            _incident("inc-b1", "globex", "job-b", 150),
        ]
        self.contracts = [
            _contract("ctr-a", "acme", ended=False),
            _contract("ctr-b", "globex", ended=True),
        ]
        self.guarantees = {
            "ctr-a": _guarantee(self.contracts[0], 2, 1),
            "ctr-b": _guarantee(self.contracts[1], 1, 1),
        }
        self.credits = [
            {
                "credit_id": "cr-a",
                "contract_id": "ctr-a",
                "tenant": "acme",
                "term_start": self.contracts[0]["term_start"],
                "term_end": self.contracts[0]["term_end"],
                "amount_minor": 250_000,
                "currency": "USD",
                "eligible_failures": 2,
                "resolved_by_migration": 1,
                "ratio": 0.5,
                "issued_at": NOW.isoformat(),
            }
        ]
        self.nodes = [
            {
                "node": "node-1",
                "cluster": "local",
                "health": "healthy",
                "lemon_score": 0.0,
                "state": "in_service",
                "gpus": [{"gpu": i, "health": "healthy"} for i in range(8)],
            },
            {
                "node": "node-2",
                "cluster": "local",
                "health": "unhealthy",
                "lemon_score": 0.5,
                "state": "draining",
                "gpus": [{"gpu": 3, "health": "unhealthy"}],
            },
            {
                "node": "node-3",
                "cluster": "local",
                "health": "quarantined",
                "lemon_score": 2.0,
                "state": "quarantined",
                "gpus": [],
            },
        ]
        self.spares = [
            {
                "slot_id": "local.spare-1.0",
                "cluster": "local",
                "node": "spare-1",
                "gpu": 0,
                "nvlink_domain": "nvl-0",
                "state": "idle",
            },
            {
                "slot_id": "local.spare-1.1",
                "cluster": "local",
                "node": "spare-1",
                "gpu": 1,
                "nvlink_domain": "nvl-0",
                "state": "idle",
            },
            {
                "slot_id": "local.spare-2.0",
                "cluster": "local",
                "node": "spare-2",
                "gpu": 0,
                "nvlink_domain": "nvl-1",
                "state": "hot",
                "job_id": "job-a",
            },
        ]
        self.depth = [
            {"cluster": "local", "nvlink_domain": "nvl-0", "available": 2, "floor": 1},
            {"cluster": "local", "nvlink_domain": "nvl-1", "available": 0, "floor": 1},
        ]
        self.requests: list[tuple[str, str, dict[str, Any]]] = []
        self.bus: Bus | None = None

    # ----------------------------------------------------------------- helpers

    def last(self, service: str, verb: str) -> dict[str, Any]:
        """The last request the API sent to ``service.verb``."""
        for s, v, body in reversed(self.requests):
            if (s, v) == (service, verb):
                return body
        raise AssertionError(f"the API never asked {service}.{verb}")

    def _by(self, items: list[dict[str, Any]], key: str, value: str, kind: str) -> dict[str, Any]:
        for item in items:
            if item[key] == value:
                return item
        raise NotFound(f"{kind} {value} does not exist", key)

    # ----------------------------------------------------------------- verbs

    def handlers(self) -> dict[tuple[str, str], Callable[[dict[str, Any]], Any]]:
        return {
            ("scheduler", "job_list"): self.job_list,
            ("scheduler", "job_get"): lambda b: (
                _only(b, "job_id"),
                self._by(self.jobs, "job_id", b["job_id"], "job"),
            )[1],
            ("scheduler", "job_timeline"): self.job_timeline,
            ("scheduler", "job_goodput"): self.job_goodput,
            ("scheduler", "tenant_goodput"): self.tenant_goodput,
            ("scheduler", "incident_list"): self.incident_list,
            ("scheduler", "incident_get"): lambda b: (
                _only(b, "incident_id"),
                self._by(self.incidents, "incident_id", b["incident_id"], "incident"),
            )[1],
            ("scheduler", "drain"): self.drain,
            ("billing", "contract_create"): self.contract_create,
            ("billing", "contract_get"): lambda b: self._by(
                self.contracts, "contract_id", b["contract_id"], "contract"
            ),
            ("billing", "contract_list"): self.contract_list,
            ("billing", "guarantee"): self.guarantee,
            ("billing", "close_term"): self.close_term,
            ("billing", "credits_list"): self.credits_list,
            ("billing", "export"): self.export,
            ("billing", "ledger_verify"): lambda b: (
                _only(b, "contract_id"),
                {"ok": True, "checked": 3, "chains": 2},
            )[1],
            ("detector", "cluster_list"): lambda b: [
                {"cluster": "local", "nodes": 3, "gpus": 9, "unhealthy": 1}
            ],
            ("detector", "node_list"): lambda b: (
                _only(b, "cluster"),
                [n for n in self.nodes if b.get("cluster") in (None, n["cluster"])],
            )[1],
            ("detector", "node_get"): lambda b: self._by(self.nodes, "node", b["node"], "node"),
            ("detector", "node_return"): lambda b: {
                **self._by(self.nodes, "node", b["node"], "node"),
                "health": "healthy",
            },
            ("spare_pool", "list"): self.spare_list,
            ("spare_pool", "get"): lambda b: self._by(self.spares, "slot_id", b["slot_id"], "slot"),
            ("spare_pool", "register"): self.register,
            ("spare_pool", "depth"): lambda b: [
                d for d in self.depth if b.get("cluster") in (None, d["cluster"])
            ],
            ("spare_pool", "return"): self.spare_return,
        }

    def job_list(self, b: dict[str, Any]) -> Any:
        _only(b, "tenant", "limit", "cursor")
        return _page([j for j in self.jobs if b.get("tenant") in (None, j["tenant"])], b)

    def job_timeline(self, b: dict[str, Any]) -> Any:
        _only(b, "job_id")
        job = self._by(self.jobs, "job_id", b["job_id"], "job")
        incidents = [i for i in self.incidents if i["job_id"] == job["job_id"]]
        return {
            "job_id": job["job_id"],
            "tenant": job["tenant"],
            "events": [
                {"type": "registered", "at": _iso(200)},
                {"type": "migration_completed", "at": _iso(29), "migration_id": "mig-1"},
            ],
            "generations": [{"generation": 1}, {"generation": 2}],
            "incidents": incidents,
            "migrations": [{"type": "migration_completed", "migration_id": "mig-1"}],
        }

    # The scheduler's goodput verbs: the real arithmetic over the canned jobs, each of which
    # ran generation 1 from 200 minutes ago and generation 2 from 29 minutes ago.
    GOODPUT_KEYS = (
        "checkpoint_every",
        "default_checkpoint_every",
        "restart_s",
        "price_per_gpu_hour_minor",
        "currency",
        "from",
        "to",
    )

    def _goodput(self, job: dict[str, Any], b: dict[str, Any]) -> tuple[Goodput, Assumptions]:
        facts = JobFacts(
            job_id=job["job_id"],
            tenant=job["tenant"],
            generations=(
                GenerationSpan(1, NOW - timedelta(minutes=200), 2),
                GenerationSpan(2, NOW - timedelta(minutes=29), 2),
            ),
            end=NOW,
            committed_step=job["committed_step"],
            step_time_s=0.5,
        )
        assumptions = Assumptions(
            checkpoint_every=b.get("checkpoint_every") or b["default_checkpoint_every"],
            restart_s=b["restart_s"],
            price_per_gpu_hour_minor=b.get("price_per_gpu_hour_minor"),
            currency=b.get("currency"),
        )
        since = datetime.fromisoformat(b["from"]) if b.get("from") else None
        until = datetime.fromisoformat(b["to"]) if b.get("to") else None
        incidents = [IncidentFacts.of(i) for i in self.incidents if i["job_id"] == job["job_id"]]
        return job_goodput(facts, incidents, assumptions, since, until), assumptions

    def job_goodput(self, b: dict[str, Any]) -> Any:
        _only(b, "job_id", *self.GOODPUT_KEYS)
        job = self._by(self.jobs, "job_id", b["job_id"], "job")
        figures, assumptions = self._goodput(job, b)
        return {
            "job_id": job["job_id"],
            "tenant": job["tenant"],
            "state": job["state"],
            "world_size": job["world_size"],
            "committed_step": job["committed_step"],
            "step_time_s": 0.5,
            **figures.summary(assumptions),
        }

    def tenant_goodput(self, b: dict[str, Any]) -> Any:
        _only(b, "tenant", *self.GOODPUT_KEYS)
        total, jobs = Goodput(), []
        for job in self.jobs:
            if job["tenant"] == b["tenant"]:
                figures, assumptions = self._goodput(job, b)
                summary = figures.summary(assumptions)
                del summary["incidents"]
                jobs.append({"job_id": job["job_id"], **summary})
                total.add(figures)
        summary = total.summary(
            Assumptions(
                b.get("checkpoint_every") or b["default_checkpoint_every"],
                b["restart_s"],
                b.get("price_per_gpu_hour_minor"),
                b.get("currency"),
            )
        )
        del summary["incidents"]
        return {"tenant": b["tenant"], **summary, "incidents": len(total.incidents), "jobs": jobs}

    def incident_list(self, b: dict[str, Any]) -> Any:
        _only(b, "job_id", "tenant", "resolution", "from", "to", "limit", "cursor")
        found = [
            i
            for i in self.incidents
            if b.get("tenant") in (None, i["tenant"])
            and b.get("job_id") in (None, i["job_id"])
            and b.get("resolution") in (None, i["resolution"])
        ]
        return _page(found, b)

    def drain(self, b: dict[str, Any]) -> Any:
        _only(b, "node", "cluster", "reason", "requested_by")
        return {
            "drain_id": "d-1",
            "cluster": b.get("cluster") or "local",
            "node": b["node"],
            "ranks": [],
        }

    def contract_create(self, b: dict[str, Any]) -> Any:
        _only(
            b,
            "contract_id",
            "tenant",
            "term_start",
            "term_end",
            "renewal_fee_minor",
            "currency",
            "threshold",
            "credit_rate",
            "count_proactive",
            "price_per_gpu_hour_minor",
        )
        if b["currency"] == "XYZ":
            raise RequestInvalid("'XYZ' is not an ISO 4217 currency code", "currency")
        return {**b, "contract_id": b.get("contract_id") or "ctr-new"}

    def contract_list(self, b: dict[str, Any]) -> Any:
        _only(b, "tenant", "limit", "cursor")
        return _page([c for c in self.contracts if b.get("tenant") in (None, c["tenant"])], b)

    def guarantee(self, b: dict[str, Any]) -> Any:
        _only(b, "contract_id", "at")
        self._by(self.contracts, "contract_id", b["contract_id"], "contract")
        return self.guarantees[b["contract_id"]]

    def close_term(self, b: dict[str, Any]) -> Any:
        _only(b, "contract_id")
        contract = self._by(self.contracts, "contract_id", b["contract_id"], "contract")
        if contract["term_end"] > NOW.isoformat():
            raise Conflict(
                f"the term of {b['contract_id']} ends {contract['term_end']}", "contract_id"
            )
        return {
            "guarantee": {**self.guarantees[b["contract_id"]], "final": True},
            "credit": None,
            "closed_now": True,
        }

    def credits_list(self, b: dict[str, Any]) -> Any:
        _only(b, "contract_id", "tenant")
        return {
            "items": [
                c
                for c in self.credits
                if b.get("tenant") in (None, c["tenant"])
                and b.get("contract_id") in (None, c["contract_id"])
            ],
            "next_cursor": None,
        }

    def export(self, b: dict[str, Any]) -> Any:
        _only(b, "period", "format")
        if b["format"] == "csv":
            body = "BilledCost,ChargeCategory\n-2500.00,Credit\n"
            return {"content_type": "text/csv; charset=utf-8", "body": body, "rows": 1}
        return {
            "content_type": "application/json",
            "rows": 1,
            "body": '[{"BilledCost": "-2500.00", "ChargeCategory": "Credit"}]',
        }

    def spare_list(self, b: dict[str, Any]) -> Any:
        _only(b, "cluster", "state", "limit", "cursor")
        return _page(
            [
                s
                for s in self.spares
                if b.get("state") in (None, s["state"]) and b.get("cluster") in (None, s["cluster"])
            ],
            b,
        )

    def spare_return(self, b: dict[str, Any]) -> Any:
        _only(b, "node", "gpu", "cluster")
        returned = [s["slot_id"] for s in self.spares if s["node"] == b["node"]]
        if not returned:
            raise NotFound(f"node {b['node']} holds no spare slot", "node")
        return {"returned": returned}

    def register(self, b: dict[str, Any]) -> Any:
        _only(
            b,
            "slot_id",
            "cluster",
            "node",
            "gpu",
            "gpu_model",
            "memory_mb",
            "nvlink_domain",
            "rack",
            "zone",
        )
        slot_id = b.get("slot_id") or f"{b.get('cluster', 'local')}:{b['node']}:{b['gpu']}"
        return {"slot": {**b, "slot_id": slot_id, "state": "idle"}, "previous_state": None}

    # ----------------------------------------------------------------- serving

    async def start(self, nats_url: str, only: set[str] | None = None) -> None:
        """Serve every verb (or those of the services in ``only``) on ``nats_url``."""
        self.bus = await Bus.connect(nats_url, "canned")
        for (service, verb), handler in self.handlers().items():
            if only is not None and service not in only:
                continue
            await self.bus.serve(service, verb, self._recorded(service, verb, handler))
        await self.bus.confirm()

    def _recorded(
        self, service: str, verb: str, handler: Callable[[dict[str, Any]], Any]
    ) -> Callable[[dict[str, Any]], Awaitable[Any]]:
        async def _serve(body: dict[str, Any]) -> Any:
            self.requests.append((service, verb, body))
            return handler(body)

        return _serve

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.close()


class ServerThread:
    """A real uvicorn server for ``app`` on a free port, on a background loop."""

    def __init__(self, loop: BackgroundLoop, app: Any) -> None:
        self.loop = loop
        self.server = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=0, log_config=None, access_log=False, lifespan="on"
            )
        )
        self.task: asyncio.Task[None] | None = None
        self.port = 0

    async def _start(self) -> int:
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.task.done():
                await self.task
                raise RuntimeError("uvicorn did not start")
            await asyncio.sleep(0.01)
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    def start(self) -> str:
        self.port = self.loop.run(self._start())
        return f"http://127.0.0.1:{self.port}"

    async def _stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.task, 10)

    def stop(self) -> None:
        self.loop.run(self._stop())
