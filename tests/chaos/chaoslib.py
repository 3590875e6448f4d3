"""Fault injection and the shared invariants of the chaos scenarios.

Every scenario runs a real 4-rank gloo job of the example script under ``torchrelay run``
against a supervised stack (tests/harness.py), injects its faults, and then calls
:func:`check_invariants`, which checks what a user of the control plane relies on:

- every injected failure is an incident exactly once, with the expected resolution, and the
  ledger holds it exactly once (the contract chain grows by exactly the job's incidents, the
  chain verifies, the guarantee's counts move by exactly what those incidents are worth);
- no spare is leaked or held twice (no slot stuck ``reserved``, no member on two slots, no
  slot of a finished job still offered);
- every incident closes (no ``open`` left);
- where the job survives, its final per-rank state digests equal the fault-free run's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from tests.harness import Stack, digests, run_job, wait_until
from torchrelay.bus import Bus
from torchrelay.contract import Subjects

NPROC = 4
STEPS = 80
STEP_SLEEP = "0.1"
JOB_TIMEOUT_S = 240.0
# A fault lands once the job has committed this many steps (the migration is then mid-run).
INJECT_AT_STEP = 5
# Under a loaded CI machine 2 s of silence is not a lost worker; the SIGSTOP scenario still
# sees a hung worker declared lost after this many seconds.
# Step times on a shared CI machine vary far more than 1.3x: a straggler warning there is noise
# that would add incidents the scenarios did not inject (the straggler rule has its own tests).
STACK_ENV = {
    "TORCHRELAY_DETECTOR_HEARTBEAT_TIMEOUT_S": "6",
    # Kept above the heartbeat timeout, as the defaults are (2 s < 5 s): a stopped worker is
    # then declared lost before its peers' stall is reported as a job-wide hang.
    "TORCHRELAY_DETECTOR_HANG_FLOOR_S": "15",
    "TORCHRELAY_DETECTOR_STRAGGLER_RATIO": "20",
    "TORCHRELAY_DETECTOR_STRAGGLER_SUSTAIN_S": "600",
}


def trace(what: str) -> None:
    """A timestamped progress line (shown with ``-s``, and in a failed scenario's output)."""
    print(f"[chaos {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


@dataclass
class Recorder:
    """Counts the invariants one scenario checked (for the session's table)."""

    checked: list[str] = field(default_factory=list)

    def ok(self, what: str) -> None:
        self.checked.append(what)


@dataclass
class Job:
    """A running ``torchrelay run`` of the example script."""

    job_id: str
    proc: subprocess.Popen[bytes]
    out: Path

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            raise AssertionError(
                f"job {self.job_id} did not finish within {timeout:.0f}s; "
                f"see {self.out.parent / (self.job_id + '.log')}"
            ) from None

    def log(self) -> str:
        path = self.out.parent / f"{self.job_id}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """Stop the launcher (and so its children) if it still runs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_job(
    stack: Stack,
    tmp: Path,
    job_id: str,
    *,
    spares: int,
    policy: str = "wait",
    run_args: list[str] | None = None,
) -> Job:
    """Start the standard chaos job (4 ranks, ``STEPS`` steps, a sleep per step);
    ``run_args`` go to ``torchrelay run``."""
    out = tmp / job_id
    trace(f"start job {job_id} (spares={spares}, policy={policy})")
    proc = run_job(
        stack,
        job_id,
        nproc=NPROC,
        spares=spares,
        steps=STEPS,
        out=out,
        policy=policy,
        extra=["--step-sleep", STEP_SLEEP],
        run_args=run_args,
    )
    return Job(job_id, proc, out)


# --------------------------------------------------------------------------- API reads


def api_get(stack: Stack, path: str, **params: Any) -> Any:
    """GET through the API; None while the API (or a service behind it) cannot answer."""
    try:
        with stack.api() as client:
            resp = client.get(path, params={k: v for k, v in params.items() if v is not None})
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return resp.json()


def api_items(stack: Stack, path: str, **params: Any) -> list[dict[str, Any]] | None:
    """Every item of a paged list (None while it cannot be read)."""
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = api_get(stack, path, limit=200, cursor=cursor, **params)
        if page is None:
            return None
        items.extend(page["items"])
        cursor = page.get("next_cursor")
        if not cursor:
            return items


def ensure_contract(stack: Stack) -> str:
    """The guarantee contract of tenant ``acme`` on this stack (created once)."""
    start = (datetime.now(UTC) - timedelta(days=1)).replace(microsecond=0)
    body = {
        "tenant": "acme",
        "term_start": start.isoformat(),
        "term_end": (start + timedelta(days=30)).isoformat(),
        "renewal_fee_minor": 1_000_000,
        "currency": "USD",
    }

    def create() -> str | None:
        existing = api_items(stack, "/v1/contracts")
        if existing is None:
            return None
        now = datetime.now(UTC)
        for c in existing:
            start_at = datetime.fromisoformat(c["term_start"].replace("Z", "+00:00"))
            end_at = datetime.fromisoformat(c["term_end"].replace("Z", "+00:00"))
            if c["tenant"] == "acme" and start_at <= now < end_at:
                return str(c["contract_id"])
        try:
            with stack.api() as client:
                resp = client.post("/v1/contracts", json=body)
        except httpx.HTTPError:
            return None
        if resp.status_code in (200, 201):
            return str(resp.json()["contract_id"])
        return None

    return str(wait_until(create, 60, "POST /v1/contracts for tenant acme", interval=0.5))


def job_step(stack: Stack, job_id: str) -> int:
    view = api_get(stack, f"/v1/jobs/{job_id}")
    if not view or view.get("state") != "running":
        return -1
    step = view.get("committed_step")
    return int(step) if step is not None else -1


def wait_mid_run(stack: Stack, job: Job, at_step: int = INJECT_AT_STEP) -> None:
    """Block until the job runs and committed ``at_step`` steps (the moment to inject)."""

    def ready() -> bool:
        if job.proc.poll() is not None:
            raise AssertionError(f"job {job.job_id} ended before the fault:\n{job.log()[-3000:]}")
        return job_step(stack, job.job_id) >= at_step

    wait_until(ready, 150, f"job {job.job_id} running at step {at_step}", interval=0.2)
    trace(f"job {job.job_id} at step >= {at_step}")


def incidents(stack: Stack, job_id: str) -> list[dict[str, Any]] | None:
    return api_items(stack, "/v1/incidents", job_id=job_id)


def wait_incident(stack: Stack, job_id: str, count: int = 1, timeout: float = 60) -> None:
    """Block until the job has at least ``count`` incidents (open or closed)."""
    wait_until(
        lambda: len(incidents(stack, job_id) or []) >= count,
        timeout,
        f"{count} incident(s) of job {job_id}",
        interval=0.2,
    )


def wait_until_closed(stack: Stack, job_id: str, timeout: float = 120) -> list[dict[str, Any]]:
    """Block until the job has incidents and none is open; them."""

    def closed() -> list[dict[str, Any]] | None:
        got = incidents(stack, job_id)
        if not got or any(i["resolution"] == "open" for i in got):
            return None
        return got

    return list(wait_until(closed, timeout, f"the incidents of {job_id} closed", interval=0.5))


# --------------------------------------------------------------------------- faults


def chaos_cli(stack: Stack, *argv: str) -> dict[str, Any]:
    """``torchrelay chaos ...`` against the stack; its JSON answer."""
    proc = subprocess.run(
        [sys.executable, "-m", "torchrelay.cli", "chaos", *argv],
        env=stack.env(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, (
        f"torchrelay chaos {' '.join(argv)} exited {proc.returncode}: {proc.stderr.decode()}"
    )
    result: dict[str, Any] = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    trace(f"chaos {' '.join(argv)}: {result}")
    return result


def kill_rank(stack: Stack, job_id: str, rank: int) -> dict[str, Any]:
    return chaos_cli(stack, "kill", "--job", job_id, "--rank", str(rank))


def hang_rank(stack: Stack, job_id: str, rank: int) -> dict[str, Any]:
    return chaos_cli(stack, "hang", "--job", job_id, "--rank", str(rank))


def launcher_pid(stack: Stack, job_id: str, member_id: str) -> dict[str, Any]:
    """The launcher's answer for one member: ``{member_id, pid, alive, rank, generation}``."""

    async def ask() -> dict[str, Any]:
        bus = await Bus.connect(stack.nats_url, "chaos-test", timeout=10.0)
        try:
            got = await bus.request(
                Subjects.launcher(job_id, "pid"), {"member_id": member_id}, timeout=10.0
            )
        finally:
            await bus.close()
        assert isinstance(got, dict)
        return got

    return asyncio.run(ask())


def service_pid(stack: Stack, name: str) -> int:
    stack.reload()
    section = "servers" if name in ("nats", "redis") else "services"
    return int(stack.info[section][name]["pid"])


def signal_service(stack: Stack, name: str, sig: signal.Signals) -> int:
    """Send ``sig`` to a service (or server) of the stack; its pid."""
    pid = service_pid(stack, name)
    os.kill(pid, sig)
    trace(f"{sig.name} to {name} (pid {pid})")
    return pid


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def wait_restarted(stack: Stack, name: str, old_pid: int, timeout: float = 90) -> int:
    """Block until the supervisor runs ``name`` again under a new pid (and, for a service,
    its /readyz answers); the new pid."""

    def restarted() -> int | None:
        try:
            pid = service_pid(stack, name)
        except (OSError, KeyError, ValueError):
            return None
        if pid == old_pid:
            return None
        if name not in ("nats", "redis"):
            port = int(stack.info["services"][name]["port"])
            if not _ready(port):
                return None
        return pid

    pid = int(wait_until(restarted, timeout, f"{name} restarted by the supervisor", 0.2))
    trace(f"{name} back as pid {pid}")
    return pid


def all_ready(stack: Stack) -> dict[str, bool]:
    stack.reload()
    return {n: _ready(int(s["port"])) for n, s in stack.info["services"].items()}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purpose.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


# --------------------------------------------------------------------------- invariants


@dataclass(frozen=True)
class Expect:
    """One injected failure: the incident it must produce."""

    rank: int
    resolutions: frozenset[str] = frozenset({"migrated_live"})
    kinds: frozenset[str] = frozenset({"worker_lost"})


@dataclass(frozen=True)
class Baseline:
    """What the ledger said before the scenario."""

    checked: int
    eligible: int
    resolved: int
    prevented: int


def guarantee(stack: Stack, contract_id: str) -> dict[str, Any]:
    return dict(
        wait_until(
            lambda: api_get(stack, f"/v1/contracts/{contract_id}/guarantee"),
            60,
            "the contract's guarantee",
            interval=0.5,
        )
    )


def ledger(stack: Stack, contract_id: str) -> dict[str, Any]:
    return dict(
        wait_until(
            lambda: api_get(stack, "/v1/ledger/verify", contract_id=contract_id),
            60,
            "GET /v1/ledger/verify",
            interval=0.5,
        )
    )


def baseline(stack: Stack, contract_id: str) -> Baseline:
    g = guarantee(stack, contract_id)
    return Baseline(
        checked=int(ledger(stack, contract_id)["checked"]),
        eligible=int(g["eligible_failures"]),
        resolved=int(g["resolved_by_migration"]),
        prevented=int(g["prevented_failures"]),
    )


def check_spares(stack: Stack, rec: Recorder, finished_jobs: tuple[str, ...] = ()) -> None:
    """No slot stuck ``reserved``, no member on two slots, nothing of a finished job offered."""

    def settled() -> tuple[list[dict[str, Any]]] | None:
        slots = api_items(stack, "/v1/spares")
        if slots is None:
            return None
        if any(s["state"] == "reserved" for s in slots):
            return None
        if any(s.get("job_id") in finished_jobs and s["state"] in ("hot", "in_use") for s in slots):
            return None
        return (slots,)  # truthy even when the pool is empty

    try:
        (slots,) = wait_until(settled, 60, "the spare pool to settle", interval=0.5)
    except AssertionError:
        slots = api_items(stack, "/v1/spares") or []
    reserved = [s["slot_id"] for s in slots if s["state"] == "reserved"]
    assert not reserved, f"spare slots stuck reserved: {reserved}"
    rec.ok("no spare stuck reserved")
    members = Counter(s["member_id"] for s in slots if s.get("member_id"))
    twice = [m for m, n in members.items() if n > 1]
    assert not twice, f"members holding two spare slots: {twice}"
    rec.ok("no spare held twice")
    leaked = [
        s["slot_id"]
        for s in slots
        if s.get("job_id") in finished_jobs and s["state"] in ("hot", "in_use")
    ]
    assert not leaked, f"slots of finished jobs still offered: {leaked} ({slots})"
    rec.ok("no spare leaked")
    trace("spares checked")


def check_invariants(
    stack: Stack,
    contract_id: str,
    before: Baseline,
    job: Job,
    expected: list[Expect],
    rec: Recorder,
    *,
    reference: dict[int, str] | None = None,
    extra_ok: int = 0,
) -> list[dict[str, Any]]:
    """The scenario's invariants (module docstring); returns the job's incidents.

    ``extra_ok``: how many incidents beyond ``expected`` are acceptable (each still has to
    close with a migration), for faults whose follow-on is legitimately a second incident.
    """
    job_id = job.job_id
    trace(f"invariants of {job_id}")

    def all_closed() -> list[dict[str, Any]] | None:
        got = incidents(stack, job_id)
        if not got or len(got) < len(expected):
            return None
        if any(i["resolution"] == "open" for i in got):
            return None
        return got

    try:
        found = wait_until(all_closed, 120, f"every incident of {job_id} closed", interval=0.5)
    except AssertionError:
        found = incidents(stack, job_id) or []
    still_open = [i["incident_id"] for i in found if i["resolution"] == "open"]
    assert not still_open, f"incidents left open: {still_open}"
    rec.ok("every incident closed")
    trace(f"incidents closed: {_brief(found)}")

    # Each injected failure: exactly one incident on its rank, with the expected resolution.
    ids = Counter(i["incident_id"] for i in found)
    assert all(n == 1 for n in ids.values()), f"an incident listed twice: {ids}"
    remaining = list(found)
    for exp in expected:
        match = [
            i
            for i in remaining
            if i["rank"] == exp.rank
            and i["fault_kind"] in exp.kinds
            and i["resolution"] in exp.resolutions
        ]
        assert match, (
            f"no incident for the failure of rank {exp.rank} ({sorted(exp.kinds)} → "
            f"{sorted(exp.resolutions)}); incidents: {_brief(found)}"
        )
        remaining.remove(match[0])
    assert len(remaining) <= extra_ok, f"unexpected incidents: {_brief(remaining)}"
    assert all(i["resolution"] == "migrated_live" for i in remaining), _brief(remaining)
    rec.ok("each injected failure is one incident with the expected resolution")

    # The ledger: every closed incident recorded exactly once, the chain intact, the
    # guarantee's counts moved by exactly these incidents.
    n = len(found)
    live = sum(1 for i in found if i["resolution"] == "migrated_live")
    proactive = sum(1 for i in found if i["resolution"] == "migrated_proactive")
    excluded = sum(
        1 for i in found if i["fault_kind"] == "application_error" or i["resolution"] == "excluded"
    )

    def ledger_caught_up() -> dict[str, Any] | None:
        got = api_get(stack, "/v1/ledger/verify", contract_id=contract_id)
        if got is None or int(got["checked"]) < before.checked + n:
            return None
        return dict(got)

    try:
        verified = wait_until(ledger_caught_up, 60, "the ledger to record the incidents", 0.5)
    except AssertionError:
        verified = ledger(stack, contract_id)
    assert verified["ok"], f"ledger chain broken: {verified}"
    rec.ok("ledger chain verifies")
    assert int(verified["checked"]) == before.checked + n, (
        f"the ledger holds {int(verified['checked']) - before.checked} new entries for "
        f"{n} incidents"
    )
    rec.ok("each incident in the ledger exactly once")
    g = guarantee(stack, contract_id)
    assert int(g["eligible_failures"]) - before.eligible == n - proactive - excluded, g
    assert int(g["resolved_by_migration"]) - before.resolved == live, g
    assert int(g["prevented_failures"]) - before.prevented == proactive, g
    rec.ok("guarantee counts moved by exactly these incidents")
    trace("ledger and guarantee checked")

    check_spares(stack, rec, (job_id,))

    if reference is not None:
        got = digests(job.out)
        assert got == reference, (
            f"final state differs from the fault-free run: {got} vs {reference}"
        )
        rec.ok("final state bitwise equal to the fault-free run")
    ready = all_ready(stack)
    assert all(ready.values()), f"services not ready after the scenario: {ready}"
    rec.ok("every service ready")
    return list(found)


def _brief(found: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (
            i["rank"],
            i["member_id"] if "member_id" in i else i.get("gpu"),
            i["fault_kind"],
            i["resolution"],
        )
        for i in found
    ]


def wait_job_ok(job: Job, timeout: float = JOB_TIMEOUT_S) -> None:
    code = job.wait(timeout)
    trace(f"job {job.job_id} exited {code}")
    assert code == 0, f"job {job.job_id} exited {code}:\n{job.log()[-4000:]}"
