"""The read-only operator dashboard at ``/ui``: server-rendered HTML, no front-end build.

Sign in by opening ``/ui/login?token=<operator token>`` once: it sets an HttpOnly cookie
scoped to ``/ui`` and redirects to ``/ui`` (an ``Authorization: Bearer`` header works too).
The page reloads itself every ``TORCHRELAY_UI_REFRESH_S`` seconds (meta refresh; no script).
Every figure carries a ``data-testid`` and its number in ``data-*`` attributes, so a test can
compare what the page shows with what the API answers.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from datetime import UTC, datetime, timedelta
from html import escape
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from services.api.auth import Principal, TokenStoreUnavailable
from services.api.gateway import ApiProblem, Gateway, items_of, parse_list
from services.api.models import Contract, Guarantee, Incident, NodeView, SpareDepth
from services.api.state import state_of

COOKIE = "torchrelay_ui"
MAX_INCIDENTS = 5000
MAX_CONTRACTS = 200
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; form-action 'self'"


def _a(value: object) -> str:
    """An HTML attribute value, escaped."""
    return escape(str(value), quote=True)


# --------------------------------------------------------------------------- pure figures


def incident_buckets(
    detected: list[datetime], now: datetime
) -> tuple[str, list[tuple[datetime, int]]]:
    """Incidents per hour over the last 24 h, or per day over 30 days if any is older.

    Returns the bucket unit (``hour`` or ``day``) and (bucket start, count) oldest first.
    Incidents older than the window are left out of the buckets (the total still counts them).
    """
    oldest = min(detected, default=now)
    if now - oldest <= timedelta(hours=24):
        unit, step, n = "hour", timedelta(hours=1), 24
        end = now.replace(minute=0, second=0, microsecond=0) + step
    else:
        unit, step, n = "day", timedelta(days=1), 30
        end = now.replace(hour=0, minute=0, second=0, microsecond=0) + step
    start = end - n * step
    counts = [0] * n
    for t in detected:
        index = math.floor((t - start) / step)
        if index >= n:  # a clock a little ahead of ours: count it as now
            index = n - 1
        if index >= 0:
            counts[index] += 1
    return unit, [(start + i * step, counts[i]) for i in range(n)]


def gauge_svg(ratio: float, threshold: float, met: bool) -> str:
    """A half-circle gauge of ``ratio`` (0..1) with a tick at ``threshold``, inline SVG."""
    r, cx, cy = 50.0, 60.0, 60.0

    def point(fraction: float) -> tuple[float, float]:
        angle = math.pi * (1.0 - min(max(fraction, 0.0), 1.0))
        return cx + r * math.cos(angle), cy - r * math.sin(angle)

    x, y = point(ratio)
    tx, ty = point(threshold)
    tx2, ty2 = cx + (tx - cx) * 0.78, cy + (ty - cy) * 0.78
    colour = "#2e7d32" if met else "#c62828"
    value_arc = (
        f'<path d="M 10 60 A 50 50 0 0 1 {x:.2f} {y:.2f}" fill="none" '
        f'stroke="{colour}" stroke-width="12"/>'
        if ratio > 0
        else ""
    )
    return (
        '<svg viewBox="0 0 120 70" width="180" height="105" role="img" '
        f'aria-label="{ratio * 100:.1f}% resolved by migration">'
        '<path d="M 10 60 A 50 50 0 0 1 110 60" fill="none" stroke="#ddd" stroke-width="12"/>'
        f"{value_arc}"
        f'<line x1="{tx:.2f}" y1="{ty:.2f}" x2="{tx2:.2f}" y2="{ty2:.2f}" stroke="#333" '
        'stroke-width="2"/>'
        f'<text x="60" y="58" text-anchor="middle" font-size="16">{ratio * 100:.1f}%</text>'
        "</svg>"
    )


def bars_svg(counts: list[int], width: int = 480, height: int = 80) -> str:
    """A bar chart of ``counts``, inline SVG."""
    top = max(counts, default=0) or 1
    bar = width / max(len(counts), 1)
    rects = []
    for i, c in enumerate(counts):
        h = (height - 4) * c / top
        rects.append(
            f'<rect x="{i * bar + 1:.1f}" y="{height - h:.1f}" width="{bar - 2:.1f}" '
            f'height="{h:.1f}" fill="#1565c0"><title>{c}</title></rect>'
        )
    return (
        f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="incidents over time">{"".join(rects)}</svg>'
    )


# --------------------------------------------------------------------------- panels


async def _all_pages(
    gw: Gateway, service: str, verb: str, payload: dict[str, Any], cap: int
) -> list[Any]:
    items: list[Any] = []
    cursor: str | None = None
    while len(items) < cap:
        data = await gw.call(service, verb, {**payload, "limit": 500, "cursor": cursor})
        page, cursor = items_of(data, service, verb)
        items.extend(page)
        if cursor is None or not page or isinstance(data, list):
            break
    return items[:cap]


def _error(panel: str, exc: ApiProblem) -> str:
    return f'<p class="error" data-testid="{_a(panel)}-error">{escape(exc.detail)}</p>'


async def fleet_panel(gw: Gateway) -> str:
    """Fleet health by node."""
    try:
        raw, _ = items_of(await gw.call("detector", "node_list", {}), "detector", "node_list")
        nodes = parse_list(NodeView, raw, "detector", "node_list")
    except ApiProblem as exc:
        return _error("fleet", exc)
    by_health = Counter(n.health for n in nodes)
    summary = "".join(
        f'<span class="pill h-{_a(h)}" data-testid="health-{_a(h)}" data-count="{c}">'
        f"{escape(h)}: {c}</span>"
        for h, c in sorted(by_health.items())
    )
    rows = "".join(
        f'<tr data-testid="node-{_a(n.node)}" data-node="{_a(n.node)}" '
        f'data-health="{_a(n.health)}" data-lemon-score="{n.lemon_score:.4f}" '
        f'data-gpus="{len(n.gpus)}"><td>{escape(n.cluster)}</td><td>{escape(n.node)}</td>'
        f'<td class="h-{_a(n.health)}">{escape(n.health)}</td><td>{escape(n.state)}</td>'
        f"<td>{n.lemon_score:.2f}</td><td>{len(n.gpus)}</td></tr>"
        for n in sorted(nodes, key=lambda n: (n.cluster, n.node))
    )
    return (
        f'<p><span data-testid="nodes-total" data-count="{len(nodes)}">{len(nodes)}</span> '
        f"nodes {summary}</p><table><thead><tr><th>cluster</th><th>node</th>"
        "<th>health</th><th>state</th><th>lemon score</th><th>GPUs</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


async def spares_panel(gw: Gateway) -> str:
    """Spare depth by NVLink domain, against its floor."""
    try:
        raw, _ = items_of(await gw.call("spare_pool", "depth", {}), "spare_pool", "depth")
        depth = parse_list(SpareDepth, raw, "spare_pool", "depth")
    except ApiProblem as exc:
        return _error("spares", exc)
    total = sum(d.available for d in depth)
    top = max([d.available for d in depth] + [d.floor for d in depth] + [1])
    rows = []
    for d in sorted(depth, key=lambda d: (d.cluster, d.nvlink_domain)):
        low = d.available < d.floor
        width = 200 * d.available / top
        rows.append(
            f'<tr data-testid="depth-{_a(d.cluster)}-{_a(d.nvlink_domain)}" '
            f'data-available="{d.available}" data-floor="{d.floor}" data-low="{str(low).lower()}">'
            f"<td>{escape(d.cluster)}</td><td>{escape(d.nvlink_domain)}</td>"
            f'<td>{d.available}</td><td>{d.floor}</td><td><svg width="200" height="12">'
            f'<rect width="{width:.1f}" height="12" fill="{"#c62828" if low else "#2e7d32"}"/>'
            f'<line x1="{200 * d.floor / top:.1f}" x2="{200 * d.floor / top:.1f}" y1="0" '
            'y2="12" stroke="#333"/></svg></td></tr>'
        )
    return (
        f'<p><span data-testid="spares-total" data-count="{total}">{total}</span> spares '
        "available</p><table><thead><tr><th>cluster</th><th>NVLink domain</th>"
        "<th>available</th><th>floor</th><th></th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


async def incidents_panel(gw: Gateway, now: datetime) -> str:
    """Incidents over time, and how they were resolved."""
    try:
        raw = await _all_pages(gw, "scheduler", "incident_list", {}, MAX_INCIDENTS)
        incidents = parse_list(Incident, raw, "scheduler", "incident_list")
    except ApiProblem as exc:
        return _error("incidents", exc)
    unit, buckets = incident_buckets([i.detected_at for i in incidents], now)
    by_resolution = Counter(i.resolution.value for i in incidents)
    pills = "".join(
        f'<span class="pill" data-testid="incidents-{_a(r)}" data-count="{c}">{escape(r)}: '
        f"{c}</span>"
        for r, c in sorted(by_resolution.items())
    )
    cells = "".join(
        f'<li data-testid="incidents-bucket-{i}" data-start="{_a(start.isoformat())}" '
        f'data-count="{count}">{escape(start.strftime("%Y-%m-%d %H:%M"))}: {count}</li>'
        for i, (start, count) in enumerate(buckets)
        if count
    )
    return (
        f'<p><span data-testid="incidents-total" data-count="{len(incidents)}">'
        f"{len(incidents)}</span> incidents {pills}</p>"
        f"<p>per {unit}, last {len(buckets)} {unit}s (UTC), oldest on the left</p>"
        f'{bars_svg([c for _, c in buckets])}<ul class="buckets" data-unit="{unit}">'
        f"{cells}</ul>"
    )


async def guarantees_panel(gw: Gateway) -> str:
    """Each contract's guarantee for its current term, as a gauge."""
    try:
        raw = await _all_pages(gw, "billing", "contract_list", {}, MAX_CONTRACTS)
        contracts = parse_list(Contract, raw, "billing", "contract_list")
    except ApiProblem as exc:
        return _error("guarantees", exc)

    async def one(c: Contract) -> Guarantee | ApiProblem:
        try:
            return await gw.fetch(Guarantee, "billing", "guarantee", {"contract_id": c.contract_id})
        except ApiProblem as exc:
            return exc

    results = await asyncio.gather(*(one(c) for c in contracts))
    cards = []
    for c, g in sorted(zip(contracts, results, strict=True), key=lambda p: p[0].contract_id):
        head = f"<h3>{escape(c.tenant)} <small>{escape(c.contract_id)}</small></h3>"
        if isinstance(g, ApiProblem):
            cards.append(f'<div class="card">{head}{_error("guarantee", g)}</div>')
            continue
        cards.append(
            f'<div class="card" data-testid="guarantee-{_a(c.contract_id)}" '
            f'data-contract-id="{_a(c.contract_id)}" data-tenant="{_a(c.tenant)}" '
            f'data-ratio="{g.ratio:.4f}" data-threshold="{g.threshold:.4f}" '
            f'data-met="{str(g.met).lower()}" data-eligible-failures="{g.eligible_failures}" '
            f'data-resolved-by-migration="{g.resolved_by_migration}" '
            f'data-prevented-failures="{g.prevented_failures}" '
            f'data-credit-minor="{g.credit_minor}">{head}'
            f"{gauge_svg(g.ratio, g.threshold, g.met)}"
            f"<p>{g.resolved_by_migration} of {g.eligible_failures} failures resolved by "
            f"migration (threshold {g.threshold * 100:.0f}%); {g.prevented_failures} "
            f"prevented; {'met' if g.met else 'missed'}; credit {g.credit_minor} "
            f"{escape(g.currency)} minor units{' (final)' if g.final else ''}</p></div>"
        )
    if not cards:
        return '<p data-testid="guarantees-empty">no contracts yet</p>'
    return f'<div class="cards">{"".join(cards)}</div>'


_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5rem;color:#222}
section{margin-bottom:2rem}table{border-collapse:collapse}
td,th{padding:.2rem .6rem;border-bottom:1px solid #eee;text-align:left}
.pill{display:inline-block;margin:0 .3rem;padding:0 .5rem;border-radius:1rem;background:#eee}
.h-healthy{color:#2e7d32}.h-degraded{color:#ef6c00}.h-unhealthy,.h-lemon{color:#c62828}
.h-quarantined{color:#6a1b9a}.cards{display:flex;flex-wrap:wrap;gap:1rem}
.card{border:1px solid #ddd;border-radius:.5rem;padding:.5rem 1rem;max-width:22rem}
.error{color:#c62828}.buckets{columns:3;font-size:.8rem}
"""


def _page(title: str, body: str, refresh_s: int | None = None) -> str:
    refresh = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s else ""
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">{refresh}'
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head>"
        f"<body>{body}</body></html>"
    )


def _html(text: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(
        text,
        status_code=status,
        headers={
            "Content-Security-Policy": _CSP,
            "Cache-Control": "no-store",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
        },
    )


async def _operator(request: Request, token: str | None) -> Principal | HTMLResponse:
    _, tokens = state_of(request).require()
    if token is None:
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        token = value.strip() if scheme.lower() == "bearer" else request.cookies.get(COOKIE)
    try:
        who = await tokens.authenticate(token) if token else None
    except TokenStoreUnavailable as exc:
        return _html(
            _page("torchrelay: unavailable", f"<h1>Unavailable</h1><p>{escape(str(exc))}</p>"), 503
        )
    if who is None:
        return _html(
            _page(
                "torchrelay: sign in",
                (
                    '<h1 data-testid="signin">Sign in</h1>'
                    "<p>Open <code>/ui/login?token=&lt;operator "
                    "token&gt;</code> once (the operator token is in <code>stack.json</code>); the "
                    "dashboard keeps it in a cookie for this browser.</p>"
                ),
            ),
            401,
        )
    if not who.is_operator:
        return _html(
            _page(
                "torchrelay: forbidden",
                (
                    '<h1 data-testid="forbidden">Operators only</h1><p>This token is a tenant '
                    "token; the dashboard shows every tenant and needs an operator token.</p>"
                ),
            ),
            403,
        )
    return who


def add_ui(app: FastAPI) -> None:
    """Register ``/ui``, ``/ui/login`` and ``/ui/logout`` on ``app``."""

    @app.get("/ui/login", include_in_schema=False)
    async def ui_login(
        request: Request, token: Annotated[str, Query(min_length=1, max_length=512)]
    ) -> Response:
        who = await _operator(request, token)
        if isinstance(who, HTMLResponse):
            return who
        response = RedirectResponse("/ui", status_code=303)
        response.set_cookie(
            COOKIE,
            token,
            httponly=True,
            samesite="strict",
            path="/ui",
            secure=request.url.scheme == "https",
            max_age=12 * 3600,
        )
        return response

    @app.get("/ui/logout", include_in_schema=False)
    async def ui_logout() -> Response:
        response = RedirectResponse("/ui", status_code=303)
        response.delete_cookie(COOKIE, path="/ui")
        return response

    @app.get("/ui", include_in_schema=False)
    async def dashboard(request: Request) -> Response:
        who = await _operator(request, None)
        if isinstance(who, HTMLResponse):
            return who
        st = state_of(request)
        gw, _ = st.require()
        now = datetime.now(UTC)
        fleet, spares, incidents, guarantees = await asyncio.gather(
            fleet_panel(gw), spares_panel(gw), incidents_panel(gw, now), guarantees_panel(gw)
        )
        refresh = st.settings.ui_refresh_s if st.settings else 10
        body = (
            "<h1>torchrelay</h1>"
            f'<p>operator dashboard, <span data-testid="rendered-at">{now:%Y-%m-%d %H:%M:%S}'
            f'</span> UTC, refreshed every {refresh} s · <a href="/ui/logout">sign out</a></p>'
            f'<section data-testid="fleet"><h2>Fleet health by node</h2>{fleet}</section>'
            f'<section data-testid="spares"><h2>Spare depth by domain</h2>{spares}</section>'
            f'<section data-testid="incidents"><h2>Incidents over time</h2>{incidents}'
            "</section>"
            f'<section data-testid="guarantees"><h2>Guarantees</h2>{guarantees}</section>'
        )
        return _html(_page("torchrelay dashboard", body, refresh))
