"""The command line's read commands (and ``drain``), talking to the portal API over HTTP.

Where to go: ``TORCHRELAY_API_URL`` and ``TORCHRELAY_TOKEN``, else the ``api_url`` and
``operator_token`` of ``<TORCHRELAY_HOME or ./.torchrelay>/stack.json`` written by
``torchrelay up``. Output is a rich table, or JSON with ``--json``.

Exit codes: 0 done; 1 the answer is bad news (``ledger verify`` found a bad entry) or the API
refused the request; 2 nothing to talk to or the token was refused; 3 the API or a service
behind it is unavailable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_UNAVAILABLE = 3
MAX_ITEMS = 100_000


class ClientError(Exception):
    """The command cannot go on; the message says why and what to do."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _stack_file() -> Path:
    return Path(os.environ.get("TORCHRELAY_HOME") or ".torchrelay") / "stack.json"


def endpoint() -> tuple[str, str | None]:
    """The API's URL and the bearer token to use.

    Raises:
        ClientError: neither the environment nor ``stack.json`` names an API.
    """
    url = os.environ.get("TORCHRELAY_API_URL") or None
    token = os.environ.get("TORCHRELAY_TOKEN") or None
    stack_path = _stack_file()
    if (url is None or token is None) and stack_path.is_file():
        try:
            stack = json.loads(stack_path.read_text())
        except (OSError, ValueError) as exc:
            raise ClientError(
                f"{stack_path} is unreadable ({exc}); restart the stack with "
                "`torchrelay up --detach`",
                EXIT_CONFIG,
            ) from exc
        url = url or stack.get("api_url")
        token = token or stack.get("operator_token")
    if not url:
        raise ClientError(
            f"no API to ask: set TORCHRELAY_API_URL (and TORCHRELAY_TOKEN), or start a stack "
            f"with `torchrelay up --detach` (it writes {stack_path})",
            EXIT_CONFIG,
        )
    return str(url).rstrip("/"), token


class ApiClient:
    """A small synchronous client of the portal API."""

    def __init__(self, url: str, token: str | None, timeout_s: float = 15.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url
        self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout_s)

    @classmethod
    def from_environment(cls) -> ApiClient:
        """A client for :func:`endpoint`."""
        url, token = endpoint()
        return cls(url, token)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def request(
        self, method: str, path: str, *, params: dict[str, Any] | None = None, body: Any = None
    ) -> httpx.Response:
        """Send a request; raise :class:`ClientError` for anything but a 2xx."""
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = self._http.request(method, path, params=clean, json=body)
        except httpx.HTTPError as exc:
            raise ClientError(
                f"the API at {self.url} cannot be reached ({type(exc).__name__}: {exc}); is the "
                "stack up (`torchrelay up --detach`)? TORCHRELAY_API_URL and stack.json say "
                "where it is",
                EXIT_UNAVAILABLE,
            ) from exc
        if response.is_success:
            return response
        raise _refusal(response)

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params).json()

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, body=body).json()

    def items(self, path: str, **params: Any) -> Iterator[dict[str, Any]]:
        """Every item of a list route, following ``next_cursor``."""
        cursor: str | None = None
        seen = 0
        while True:
            page = self.get(path, **params, limit=500, cursor=cursor)
            for item in page["items"]:
                seen += 1
                yield item
            cursor = page.get("next_cursor")
            if not cursor or not page["items"] or seen >= MAX_ITEMS:
                return


def _refusal(response: httpx.Response) -> ClientError:
    try:
        problem = response.json()
        detail = str(problem.get("detail") or problem.get("title") or response.text)
    except ValueError:
        problem, detail = {}, response.text[:500]
    status = response.status_code
    if status == 401:
        return ClientError(
            f"the API refused the token ({detail}); set TORCHRELAY_TOKEN, or "
            "use the operator_token of stack.json",
            EXIT_CONFIG,
        )
    if status == 403:
        return ClientError(f"this needs an operator token: {detail}", EXIT_CONFIG)
    if status in (502, 503, 504):
        return ClientError(f"unavailable ({status}): {detail}", EXIT_UNAVAILABLE)
    return ClientError(f"{status} {problem.get('title', '')}: {detail}".strip())


def _console() -> Console:
    # Tables wider than 80 columns when piped, so nothing is cut with an ellipsis.
    return Console(width=None if sys.stdout.isatty() else 200, highlight=False)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def _run(func: Any, args: argparse.Namespace) -> int:
    try:
        with ApiClient.from_environment() as api:
            return int(func(api, args))
    except ClientError as exc:
        print(f"torchrelay {getattr(args, 'command', None) or ''}: {exc}", file=sys.stderr)
        return exc.exit_code


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


# --------------------------------------------------------------------------- status


def _status(api: ApiClient, args: argparse.Namespace) -> int:
    jobs = list(api.items("/v1/jobs"))
    fleet: dict[str, list[dict[str, Any]]] = {}
    for key, path in (
        ("clusters", "/v1/clusters"),
        ("nodes", "/v1/nodes"),
        ("spares", "/v1/spares/depth"),
    ):
        try:
            fleet[key] = list(api.items(path))
        except ClientError as exc:
            if exc.exit_code != EXIT_CONFIG:  # a tenant token sees only its jobs
                raise
    if args.json:
        _print_json({"jobs": jobs, **fleet})
        return EXIT_OK
    console = _console()
    table = Table(title=f"jobs ({len(jobs)})")
    for col in (
        "job",
        "tenant",
        "state",
        "world",
        "spares",
        "generation",
        "committed step",
        "ranks",
    ):
        table.add_column(col)
    for j in jobs:
        ranks = ", ".join(f"{r['rank']}@{r['node']}:{r['gpu']}" for r in j.get("ranks", []))
        table.add_row(
            j["job_id"],
            j["tenant"],
            j["state"],
            _fmt(j["world_size"]),
            _fmt(j.get("spares")),
            _fmt(j.get("generation")),
            _fmt(j.get("committed_step")),
            ranks,
        )
    console.print(table)
    if "clusters" in fleet:
        table = Table(title="clusters")
        for col in ("cluster", "nodes", "gpus", "unhealthy", "spares available"):
            table.add_column(col)
        for c in fleet["clusters"]:
            table.add_row(
                c["cluster"],
                _fmt(c.get("nodes")),
                _fmt(c.get("gpus")),
                _fmt(c.get("unhealthy")),
                _fmt(c.get("spares_available")),
            )
        console.print(table)
    if "nodes" in fleet:
        table = Table(title=f"nodes ({len(fleet['nodes'])})")
        for col in ("cluster", "node", "health", "state", "lemon score", "gpus"):
            table.add_column(col)
        for n in fleet["nodes"]:
            table.add_row(
                n["cluster"],
                n["node"],
                n["health"],
                _fmt(n.get("state")),
                _fmt(n.get("lemon_score"), 2),
                _fmt(len(n.get("gpus", []))),
            )
        console.print(table)
    if "spares" in fleet:
        table = Table(title="spare depth")
        for col in ("cluster", "NVLink domain", "available", "floor"):
            table.add_column(col)
        for d in fleet["spares"]:
            low = " (below floor)" if d["available"] < d.get("floor", 0) else ""
            table.add_row(
                d["cluster"], d["nvlink_domain"], f"{d['available']}{low}", _fmt(d.get("floor"))
            )
        console.print(table)
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    """``torchrelay status [--json]``: jobs, clusters, nodes and spare depth."""
    return _run(_status, args)


# --------------------------------------------------------------------------- incidents


def _incidents(api: ApiClient, args: argparse.Namespace) -> int:
    incidents = list(api.items("/v1/incidents", job_id=getattr(args, "job", None)))
    if args.json:
        _print_json(incidents)
        return EXIT_OK
    table = Table(title=f"incidents ({len(incidents)})")
    for col in (
        "incident",
        "tenant",
        "job",
        "rank",
        "node:gpu",
        "fault",
        "resolution",
        "stall ms",
        "lost steps",
        "bytes moved",
        "generation",
        "detected",
    ):
        table.add_column(col)
    for i in incidents:
        gens = f"{_fmt(i.get('generation_before'))}→{_fmt(i.get('generation_after'))}"
        table.add_row(
            i["incident_id"],
            i["tenant"],
            i["job_id"],
            _fmt(i.get("rank")),
            f"{i['node']}:{_fmt(i.get('gpu'))}",
            i["fault_kind"],
            i["resolution"],
            _fmt(i.get("stall_ms")),
            _fmt(i.get("lost_steps")),
            _fmt(i.get("bytes_moved")),
            gens,
            i["detected_at"],
        )
    _console().print(table)
    return EXIT_OK


def cmd_incidents(args: argparse.Namespace) -> int:
    """``torchrelay incidents [--job ID] [--json]``."""
    return _run(_incidents, args)


# --------------------------------------------------------------------------- credits


def _credits(api: ApiClient, args: argparse.Namespace) -> int:
    contract_id = getattr(args, "contract", None)
    if contract_id:
        contracts = [api.get(f"/v1/contracts/{contract_id}")]
    else:
        contracts = list(api.items("/v1/contracts"))
    for c in contracts:
        c["guarantee"] = api.get(f"/v1/contracts/{c['contract_id']}/guarantee")
    credits = list(api.items("/v1/credits", contract_id=contract_id))
    if args.json:
        _print_json({"contracts": contracts, "credits": credits})
        return EXIT_OK
    console = _console()
    table = Table(title="guarantee per contract (current term)")
    for col in (
        "contract",
        "tenant",
        "term",
        "failures",
        "migrated",
        "prevented",
        "ratio",
        "threshold",
        "met",
        "credit",
    ):
        table.add_column(col)
    for c in contracts:
        g = c["guarantee"]
        table.add_row(
            c["contract_id"],
            c["tenant"],
            f"{c['term_start'][:10]} → {c['term_end'][:10]}",
            _fmt(g["eligible_failures"]),
            _fmt(g["resolved_by_migration"]),
            _fmt(g["prevented_failures"]),
            f"{g['ratio'] * 100:.1f}%",
            f"{g['threshold'] * 100:.0f}%",
            "yes" if g["met"] else "NO",
            f"{g['credit_minor']} {g['currency']}{' (final)' if g['final'] else ''}",
        )
    console.print(table)
    table = Table(title=f"credits issued ({len(credits)})")
    for col in ("credit", "contract", "tenant", "amount (minor units)", "ratio", "term end"):
        table.add_column(col)
    for cr in credits:
        table.add_row(
            cr["credit_id"],
            cr["contract_id"],
            cr["tenant"],
            f"{cr['amount_minor']} {cr['currency']}",
            _fmt(cr.get("ratio"), 3),
            _fmt(cr.get("term_end")),
        )
    console.print(table)
    return EXIT_OK


def cmd_credits(args: argparse.Namespace) -> int:
    """``torchrelay credits [--contract ID] [--json]``."""
    return _run(_credits, args)


# --------------------------------------------------------------------------- export


def _export(api: ApiClient, args: argparse.Namespace) -> int:
    response = api.request(
        "GET", "/v1/billing/export", params={"period": args.period, "format": args.format}
    )
    if args.output:
        Path(args.output).write_bytes(response.content)
        print(
            f"wrote {len(response.content)} bytes of FOCUS {args.format} for {args.period} "
            f"to {args.output}",
            file=sys.stderr,
        )
    else:
        sys.stdout.write(response.text)
        sys.stdout.flush()
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    """``torchrelay export --period YYYY-MM [--format csv|json] [-o FILE]``."""
    return _run(_export, args)


# --------------------------------------------------------------------------- drain


def _drain(api: ApiClient, args: argparse.Namespace) -> int:
    result = api.post(f"/v1/nodes/{args.node}/drain", {"reason": "planned maintenance"})
    detail = result.get("result") or {}
    ranks = detail.get("ranks", []) if isinstance(detail, dict) else []
    moving = ", ".join(f"{r.get('job_id')} rank {r.get('rank')}" for r in ranks) or "none"
    print(
        f"drain of {result['node']} (cluster {result.get('cluster') or '?'}) requested; "
        f"ranks moving at their next step boundary: {moving}"
    )
    return EXIT_OK


def cmd_drain(args: argparse.Namespace) -> int:
    """``torchrelay drain --node N``: move every rank off a node for maintenance."""
    return _run(_drain, args)


# --------------------------------------------------------------------------- ledger


def _ledger(api: ApiClient, args: argparse.Namespace) -> int:
    result = api.get("/v1/ledger/verify", contract_id=getattr(args, "contract", None))
    if result.get("ok"):
        print(
            f"ledger ok: {result.get('checked', 0)} entries checked"
            + (f" in {result['chains']} chains" if "chains" in result else "")
        )
        return EXIT_OK
    bad = result.get("first_bad")
    where = ", ".join(f"{k} {v}" for k, v in bad.items()) if isinstance(bad, dict) else str(bad)
    print(
        f"ledger verify FAILED after {result.get('checked', 0)} entries; first bad entry: {where}",
        file=sys.stderr,
    )
    return EXIT_FAILED


def cmd_ledger(args: argparse.Namespace) -> int:
    """``torchrelay ledger verify [--contract ID]``: exit 1 naming the first bad entry."""
    return _run(_ledger, args)


__all__ = [
    "ApiClient",
    "ClientError",
    "cmd_credits",
    "cmd_drain",
    "cmd_export",
    "cmd_incidents",
    "cmd_ledger",
    "cmd_status",
    "endpoint",
]
