"""``torchrelay demo``: the whole story on this machine, then a summary.

Starts the stack, creates a demo tenant's contract, runs a fault-free reference job, then the
same job with 2 hot spares while injecting a fatal fault (SIGKILL of one rank) and a warning
(a row-remap-pending signal on another rank's GPU), shows it live, and ends with the
failures, how they were resolved, stall and lost steps, whether the final state is bitwise
equal to the reference, the guarantee and the FOCUS export it wrote.

``--hosts K`` tells it across K hosts, each a network namespace of this machine (root
only): K-1 worker hosts of 2 ranks and a spare host of 2 hot spares, one ``torchrelay run``
launcher each, the stack listening on their bridge; the fault is the loss of a whole worker
host (every process in it killed at once), whose 2 ranks move to the spare host.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from torchrelay import netns
from torchrelay.examples import train_mlp
from torchrelay.stack import read_stack, state_dir_from

TENANT = "demo-tenant"
STEPS = 160
NPROC = 4
SPARES = 2
NODES = 3
# The counterfactual the summary prices (docs/design.md §14): the demo's job writes no
# checkpoints, so it is told what a checkpointing job would do: a checkpoint every 40 steps
# and 60 s per restart; a GPU-hour at $2.00 (the demo contract's price).
CHECKPOINT_EVERY = 40
RESTART_S = 60.0
PRICE_PER_GPU_HOUR_MINOR = 200
TIMEOUT_S = 240.0
PER_HOST = 2  # ranks of a worker host and spares of the spare host with --hosts
SPARE_HOST = "spare0"
MAX_HOSTS = 8


@dataclass
class DemoRun:
    """One launched job (a launcher per host) and what the demo has seen of it."""

    job_id: str
    out: Path
    procs: dict[str, subprocess.Popen[bytes]]
    started: float = field(default_factory=time.monotonic)
    steps_seen: list[tuple[float, int]] = field(default_factory=list)
    injected: list[str] = field(default_factory=list)
    lost_hosts: set[str] = field(default_factory=set)

    def _watched(self) -> list[subprocess.Popen[bytes]]:
        return [p for h, p in self.procs.items() if h not in self.lost_hosts]

    def running(self) -> bool:
        return any(p.poll() is None for p in self._watched())

    def terminate(self) -> None:
        for proc in self._watched():
            if proc.poll() is None:
                proc.terminate()

    def wait(self) -> int:
        """The first non-zero exit code of the launchers the demo did not kill, else 0."""
        codes = [int(p.wait()) for p in self._watched()]
        return next((c for c in codes if c != 0), 0)


class Demo:
    def __init__(
        self, state_dir: Path, console: Console, network: netns.Network | None = None
    ) -> None:
        self.state_dir = state_dir
        self.console = console
        self.stack: dict[str, Any] = {}
        self.started_stack = False
        # With --hosts: the hosts' namespaces; their launchers run there, the stack on the bridge.
        self.network = network
        self.workers = [h for h in network.hosts if h != SPARE_HOST] if network else []
        self.nproc = PER_HOST * len(self.workers) if network else NPROC

    # ------------------------------------------------------------------ stack

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "NATS_URL": self.stack["nats_url"],
                "TORCHRELAY_HOME": str(self.state_dir),
                "TORCHRELAY_API_URL": self.stack["api_url"],
                "TORCHRELAY_TOKEN": self.stack["operator_token"] or "",
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def up(self) -> None:
        existing = read_stack(self.state_dir)
        if existing is None:
            self.console.print(
                f"[bold]starting the stack[/] in {self.state_dir} "
                "(nats-server, redis-server, 6 services)…"
            )
            bind = ["--bind", self.network.gateway] if self.network else []
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torchrelay.cli",
                    "up",
                    "--detach",
                    "--state-dir",
                    str(self.state_dir),
                    *bind,
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"torchrelay up failed: {proc.stderr.strip()}")
            self.started_stack = True
        self.stack = read_stack(self.state_dir) or {}
        if self.network and self.network.gateway not in str(self.stack.get("nats_url")):
            raise RuntimeError(
                f"the stack in {self.state_dir} listens on {self.stack.get('nats_url')}, not "
                f"on the hosts' bridge {self.network.gateway}: stop it (torchrelay down "
                f"--state-dir {self.state_dir}) and run the demo again"
            )
        self.console.print(f"stack ready: api {self.stack['api_url']}")

    def down(self) -> None:
        if self.started_stack:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torchrelay.cli",
                    "down",
                    "--state-dir",
                    str(self.state_dir),
                ],
                capture_output=True,
                check=False,
            )

    def api(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.stack["api_url"],
            timeout=10.0,
            headers={"Authorization": f"Bearer {self.stack['operator_token']}"},
        )

    # ------------------------------------------------------------------ steps

    def create_contract(self) -> dict[str, Any]:
        now = datetime.now(UTC)
        body = {
            "tenant": TENANT,
            "term_start": (now - timedelta(days=1)).isoformat(),
            "term_end": (now + timedelta(days=29)).isoformat(),
            "renewal_fee_minor": 12_000_000,
            "currency": "USD",
            "threshold": 0.9,
            "credit_rate": 0.25,
            "count_proactive": True,
            "price_per_gpu_hour_minor": PRICE_PER_GPU_HOUR_MINOR,
        }
        with self.api() as api:
            resp = api.post("/v1/contracts", json=body)
            resp.raise_for_status()
            contract: dict[str, Any] = resp.json()
        self.console.print(
            f"contract {contract['contract_id']} for {TENANT}: ≥90% of failures "
            "resolved by live migration, or a 25% credit on $120,000.00"
        )
        return contract

    def launch(self, job_id: str, spares: int) -> DemoRun:
        out = self.state_dir / "demo" / job_id
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("rank*.json"):
            old.unlink()
        head = [sys.executable, "-m", "torchrelay.cli", "run"]
        tail = ["--job-id", job_id, "--tenant", TENANT, str(Path(train_mlp.__file__))]
        tail += ["--steps", str(STEPS), "--out", str(out)]
        if self.network is None:
            plan = ["--nproc", str(NPROC), "--spares", str(spares), "--nodes", str(NODES)]
            log = (out / "launcher.log").open("ab")
            proc = subprocess.Popen(
                [*head, *plan, *tail], env=self.env(), stdout=log, stderr=subprocess.STDOUT
            )
            return DemoRun(job_id, out, {"local": proc})
        env = self.env()
        env["TORCHRELAY_JOB_CLAIM"] = secrets.token_urlsafe(24)  # one per job, every host's
        env["TORCHRELAY_NATS_CREDENTIALS"] = str(
            (self.stack.get("credentials") or {}).get("launcher") or ""
        )
        if not env["TORCHRELAY_NATS_CREDENTIALS"]:
            del env["TORCHRELAY_NATS_CREDENTIALS"]
        per_host = ["--nproc-per-node", str(PER_HOST), "--simulate-gpus"]
        procs: dict[str, subprocess.Popen[bytes]] = {}
        for rank, host in enumerate(self.workers):
            plan = ["--nnodes", str(len(self.workers)), "--node-rank", str(rank), *per_host]
            log = (out / f"launcher-{host}.log").open("ab")
            cmd = [*head, *plan, "--node-name", host, *tail]
            procs[host] = self.network.spawn(host, cmd, env, log)
        if spares:
            log = (out / f"launcher-{SPARE_HOST}.log").open("ab")
            cmd = [*head, "--spare", *per_host, "--node-name", SPARE_HOST, *tail]
            procs[SPARE_HOST] = self.network.spawn(SPARE_HOST, cmd, env, log)
        return DemoRun(job_id, out, procs)

    def chaos(self, *args: str) -> None:
        subprocess.run(
            [sys.executable, "-m", "torchrelay.cli", "chaos", *args],
            env=self.env(),
            capture_output=True,
            check=False,
            timeout=30,
        )

    def job(self, job_id: str) -> dict[str, Any] | None:
        with self.api() as api:
            resp = api.get(f"/v1/jobs/{job_id}")
            return resp.json() if resp.status_code == 200 else None

    def incidents(self, job_id: str) -> list[dict[str, Any]]:
        with self.api() as api:
            resp = api.get("/v1/incidents", params={"job_id": job_id, "limit": 100})
            return list(resp.json().get("items", [])) if resp.status_code == 200 else []

    def render(self, run: DemoRun, title: str) -> Panel:
        job = self.job(run.job_id) or {}
        step = int(job.get("committed_step") or 0)
        now = time.monotonic()
        if not run.steps_seen or run.steps_seen[-1][1] != step:
            run.steps_seen.append((now, step))
        recent = [s for s in run.steps_seen if now - s[0] < 3.0]
        rate = (
            (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])
            if len(recent) > 1 and recent[-1][0] > recent[0][0]
            else 0.0
        )
        head = Table.grid(padding=(0, 2))
        head.add_row(
            f"job [bold]{run.job_id}[/]",
            f"step {step}/{STEPS}",
            f"{rate:5.1f} steps/s",
            f"generation {job.get('generation', '-')}",
            f"state {job.get('state', '…')}",
        )
        ranks = Table("rank", "node", "gpu", "pid", box=None)
        for r in job.get("ranks", []):
            ranks.add_row(
                str(r.get("rank")), str(r.get("node")), str(r.get("gpu")), str(r.get("pid") or "-")
            )
        inc = Table("incident", "fault", "rank", "resolution", "stall ms", "lost steps", box=None)
        for i in self.incidents(run.job_id):
            inc.add_row(
                i["incident_id"][:12],
                i["fault_kind"],
                str(i.get("rank")),
                i["resolution"],
                f"{i['stall_ms']:.0f}" if i.get("stall_ms") else "-",
                str(i.get("lost_steps") if i.get("lost_steps") is not None else "-"),
            )
        notes = "\n".join(run.injected) or "no fault injected yet"
        return Panel(Group(head, ranks, inc, notes), title=title)

    def watch(self, run: DemoRun, title: str, inject: bool) -> int:
        with Live(self.render(run, title), console=self.console, refresh_per_second=4) as live:
            while run.running():
                if time.monotonic() - run.started > TIMEOUT_S:
                    run.terminate()
                    break
                live.update(self.render(run, title))
                if inject:
                    self.maybe_inject(run)
                time.sleep(0.25)
            live.update(self.render(run, title))
        return run.wait()

    def maybe_inject(self, run: DemoRun) -> None:
        job = self.job(run.job_id) or {}
        step = int(job.get("committed_step") or 0)
        if self.network is not None:
            if not run.injected and step >= STEPS * 0.3:
                host = self.workers[-1]
                run.lost_hosts.add(host)
                killed = self.network.kill_host(host)
                run.injected.append(
                    f"step {step}: host {host} lost: its {len(killed)} processes (launcher, "
                    f"{PER_HOST} ranks, node agent) killed at once"
                )
            return
        if not run.injected and step >= STEPS * 0.3:
            self.chaos("kill", "--job", run.job_id, "--rank", "1")
            run.injected.append(f"step {step}: SIGKILL of rank 1 (fatal: worker lost)")
        elif len(run.injected) == 1 and step >= STEPS * 0.6:
            incidents = self.incidents(run.job_id)
            if incidents and all(i["resolution"] != "open" for i in incidents):
                slot = next((r for r in job.get("ranks", []) if r.get("rank") == 2), None)
                if slot is not None:
                    self.chaos("remap", "--node", str(slot["node"]), "--gpu", str(slot["gpu"]))
                    run.injected.append(
                        f"step {step}: row remap pending on {slot['node']} "
                        f"gpu {slot['gpu']} (warning: rank 2 moves proactively)"
                    )

    # ------------------------------------------------------------------ summary

    def summary(self, ref: DemoRun, live: DemoRun, contract: dict[str, Any]) -> bool:
        ref_d = _digests(ref.out)
        live_d = _digests(live.out)
        equal = bool(ref_d) and ref_d == live_d and len(ref_d) == self.nproc
        deadline = time.monotonic() + 30
        incidents = self.incidents(live.job_id)
        while time.monotonic() < deadline and (
            len(incidents) < 2 or any(i["resolution"] == "open" for i in incidents)
        ):
            time.sleep(0.5)
            incidents = self.incidents(live.job_id)
        failures = [i for i in incidents if i["resolution"] != "excluded"]
        migrated = [
            i for i in failures if i["resolution"] in ("migrated_live", "migrated_proactive")
        ]
        with self.api() as api:
            guarantee = api.get(f"/v1/contracts/{contract['contract_id']}/guarantee").json()
            goodput = self.goodput(api, live.job_id)
            period = datetime.now(UTC).strftime("%Y-%m")
            export = api.get("/v1/billing/export", params={"period": period, "format": "csv"})
        export_dir = self.state_dir / "exports"
        export_dir.mkdir(parents=True, exist_ok=True)
        export_path = export_dir / f"focus-{period}.csv"
        export_path.write_text(export.text if export.status_code == 200 else "")

        table = Table(title="torchrelay demo: summary", show_header=False)
        table.add_row("failures", str(len(failures)))
        table.add_row("resolved by live migration", f"{len(migrated)} of {len(failures)}")
        for i in failures:
            table.add_row(
                f"  {i['fault_kind']} (rank {i.get('rank')})",
                f"{i['resolution']}, stall {i.get('stall_ms') or 0:.0f} ms, "
                f"lost steps {i.get('lost_steps')}",
            )
        table.add_row(
            "final state vs fault-free reference",
            "bitwise equal on every rank"
            if equal
            else f"DIFFERENT (reference {len(ref_d)} ranks, live {len(live_d)})",
        )
        table.add_row(
            "guarantee",
            f"ratio {guarantee.get('ratio')}, threshold "
            f"{guarantee.get('threshold')}, met: {guarantee.get('met')}",
        )
        table.add_row(
            "credit",
            "none owed"
            if guarantee.get("met")
            else f"{guarantee.get('credit_minor')} minor units {guarantee.get('currency')}",
        )
        self.goodput_rows(table, goodput)
        table.add_row("FOCUS export", export_path.name)
        self.console.print(table)
        self.console.print(f"FOCUS 1.2 export written to {export_path}", soft_wrap=True)
        (self.state_dir / "demo" / "summary.json").write_text(
            json.dumps(
                {
                    "failures": len(failures),
                    "migrated": len(migrated),
                    "bitwise_equal": equal,
                    "incidents": failures,
                    "guarantee": guarantee,
                    "goodput": goodput,
                    "export": str(export_path),
                },
                indent=2,
                default=str,
            )
        )
        return equal and len(failures) == 2 and len(migrated) == 2

    def goodput(self, api: httpx.Client, job_id: str) -> dict[str, Any]:
        """The job's goodput once the scheduler has seen it finish (its end is then fixed)."""
        params = {"checkpoint_every": CHECKPOINT_EVERY, "restart_s": RESTART_S}
        deadline = time.monotonic() + 15
        while True:
            resp = api.get(f"/v1/jobs/{job_id}/goodput", params=params)
            found: dict[str, Any] = resp.json() if resp.status_code == 200 else {}
            if found.get("state") not in (None, "starting", "running"):
                return found
            if time.monotonic() > deadline:
                return found
            time.sleep(0.5)

    def goodput_rows(self, table: Table, g: dict[str, Any]) -> None:
        """The goodput lines of the summary: what the GPUs did, and what restarts would cost."""
        if "gpu_seconds_allocated" not in g:
            table.add_row("goodput", "not available (the API did not answer)")
            return
        ettr = g.get("ettr")
        table.add_row(
            "goodput",
            f"{g['gpu_seconds_progress']:.1f} of {g['gpu_seconds_allocated']:.1f} GPU-seconds "
            f"became progress (ETTR {ettr:.4f})"
            if ettr is not None
            else "nothing ran",
        )
        for i in g.get("incidents", []):
            table.add_row(
                f"  lost to {i['incident_id'][:12]}",
                f"{i['gpu_seconds_lost']:.3f} GPU-s = {i['stall_gpu_seconds']:.3f} stall + "
                f"{i['lost_steps_gpu_seconds']:.3f} for {i.get('lost_steps') or 0} lost steps "
                f"({i['world_size']} ranks)",
            )
        cf = g["counterfactual"]
        money = cf.get("money_saved_minor")
        priced = (
            f", ${money / 100:,.2f} at ${cf['price_per_gpu_hour_minor'] / 100:.2f}/GPU-hour"
            if money is not None
            else ""
        )
        table.add_row(
            "with checkpoint restart instead",
            f"every {cf['checkpoint_every']} steps, {cf['restart_s']:.0f} s a restart: "
            f"{cf['gpu_seconds_lost']:.1f} GPU-s lost; saved {cf['gpu_hours_saved']:.4f} "
            f"GPU-hours{priced}",
        )


def _digests(out: Path) -> dict[int, str]:
    result = {}
    for path in sorted(out.glob("rank*.json")):
        record = json.loads(path.read_text())
        result[int(record["rank"])] = str(record["sha256"])
    return result


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo; exit 0 when both failures were resolved live and the state is equal."""
    console = Console()
    state_dir = state_dir_from(getattr(args, "state_dir", None))
    hosts = getattr(args, "hosts", None)
    if hosts is None:
        return _demo(Demo(state_dir, console), console)
    if not 2 <= hosts <= MAX_HOSTS:
        print(
            f"torchrelay demo: --hosts {hosts}: give 2 to {MAX_HOSTS} (worker hosts and a "
            "spare host)",
            file=sys.stderr,
        )
        return 2
    why = netns.unavailable()
    if why is not None:
        print(
            f"torchrelay demo: --hosts needs network namespaces, and {why}; run it as root "
            "with iproute2, or without --hosts",
            file=sys.stderr,
        )
        return 2
    names = [f"host{i}" for i in range(hosts - 1)] + [SPARE_HOST]
    try:
        with netns.network(names) as network:
            return _demo_on(network, names, state_dir, console)
    except netns.NetworkError as exc:
        print(f"torchrelay demo: the hosts' network could not be made: {exc}", file=sys.stderr)
        return 2


def _demo_on(network: netns.Network, names: list[str], state_dir: Path, console: Console) -> int:
    console.print(
        f"hosts: {', '.join(f'{h} {network.hosts[h].address}' for h in names)} "
        f"(network namespaces on bridge {network.bridge} {network.gateway})"
    )
    # Its own stack, listening on the bridge, beside any stack of this state dir.
    return _demo(Demo(state_dir / "hosts", console, network), console)


def _demo(demo: Demo, console: Console) -> int:
    started = time.monotonic()
    try:
        demo.up()
        contract = demo.create_contract()
        stamp = datetime.now(UTC).strftime("%H%M%S")
        where = f" on {len(demo.workers)} hosts of {PER_HOST}" if demo.network is not None else ""
        console.print(
            f"[bold]1/2[/] fault-free reference run: {demo.nproc} ranks{where}, "
            f"{STEPS} steps, 2.4M-parameter MLP, AdamW"
        )
        ref = demo.launch(f"demo-ref-{stamp}", spares=0)
        if demo.watch(ref, "reference run (no faults)", inject=False) != 0:
            console.print(f"[red]the reference run failed; see its launcher logs in {ref.out}")
            return 1
        story = (
            f"{PER_HOST} hot spares on host {SPARE_HOST} and the loss of a whole worker host"
            if demo.network is not None
            else f"{SPARES} hot spares, a fatal fault and a warning"
        )
        console.print(f"[bold]2/2[/] the same job with {story}")
        live = demo.launch(f"demo-live-{stamp}", spares=SPARES)
        rc = demo.watch(live, "protected run", inject=True)
        if rc != 0:
            console.print(
                f"[red]the protected run exited {rc}; see the launcher logs in {live.out}"
            )
        ok = demo.summary(ref, live, contract) and rc == 0
        console.print(f"demo finished in {time.monotonic() - started:.0f} s")
        return 0 if ok else 1
    finally:
        demo.down()
