"""The operator dashboard: operator-only, and the numbers it shows are the API's numbers.

One test opens ``/ui`` in headless Chromium (Debian's ``chromium``) against a real server and
reads the figures out of the rendered DOM by their ``data-testid``.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.api.app import create_app
from services.api.settings import ApiSettings
from tests.unit.api.canned import OPERATOR_TOKEN, BackgroundLoop, CannedServices, ServerThread
from tests.unit.api.conftest import TestClient
from torchrelay.runtime import ServerProcess


class _TestIds(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, dict[str, str]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        if "data-testid" in values:
            self.found[values["data-testid"]] = values


def elements_by_testid(html: str) -> dict[str, dict[str, str]]:
    """Every element with a ``data-testid``, by id, with its attributes."""
    parser = _TestIds()
    parser.feed(html)
    return parser.found


def expected_figures(get: Any) -> dict[str, str]:
    """The figures the dashboard must show, computed from the API's own answers."""
    nodes = get("/v1/nodes?limit=500")["items"]
    depth = get("/v1/spares/depth?limit=500")["items"]
    incidents = get("/v1/incidents?limit=500")["items"]
    contracts = get("/v1/contracts?limit=500")["items"]
    out = {
        "nodes-total": str(len(nodes)),
        "spares-total": str(sum(d["available"] for d in depth)),
        "incidents-total": str(len(incidents)),
    }
    for health, count in Counter(n["health"] for n in nodes).items():
        out[f"health-{health}"] = str(count)
    for resolution, count in Counter(i["resolution"] for i in incidents).items():
        out[f"incidents-{resolution}"] = str(count)
    for d in depth:
        out[f"depth-{d['cluster']}-{d['nvlink_domain']}"] = str(d["available"])
    for c in contracts:
        g = get(f"/v1/contracts/{c['contract_id']}/guarantee")
        out[f"guarantee-{c['contract_id']}"] = f"{g['ratio']:.4f}"
    return out


def shown_figures(ids: dict[str, dict[str, str]], keys: set[str]) -> dict[str, str]:
    shown = {}
    for key in keys:
        attrs = ids.get(key, {})
        if key.startswith("guarantee-"):
            shown[key] = attrs.get("data-ratio", "?")
        elif key.startswith("depth-"):
            shown[key] = attrs.get("data-available", "?")
        else:
            shown[key] = attrs.get("data-count", "?")
    return shown


def test_dashboard_needs_an_operator(client: TestClient, acme: dict[str, str]) -> None:
    r = client.get("/ui")
    assert r.status_code == 401
    assert 'data-testid="signin"' in r.text
    assert client.get("/ui", headers=acme).status_code == 403
    assert (
        client.get(
            "/ui/login", params={"token": acme["Authorization"][7:]}, follow_redirects=False
        ).status_code
        == 403
    )
    assert (
        client.get("/ui/login", params={"token": "tr_bogus"}, follow_redirects=False).status_code
        == 401
    )


def test_login_sets_a_cookie_and_the_page_matches_the_api(
    client: TestClient,
    operator: dict[str, str],
) -> None:
    r = client.get("/ui/login", params={"token": OPERATOR_TOKEN}, follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/ui"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie
    assert "SameSite=strict" in cookie
    page = client.get("/ui")  # the cookie jar now carries the token
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert 'http-equiv="refresh"' in page.text
    assert "script" not in page.text
    expected = expected_figures(lambda p: client.get(p, headers=operator).json())
    assert shown_figures(elements_by_testid(page.text), set(expected)) == expected
    client.cookies.clear()


def test_a_panel_whose_service_is_down_says_so(
    nats_url: str,
    api_settings: ApiSettings,
    operator: dict[str, str],
) -> None:
    loop = BackgroundLoop()
    services = CannedServices()
    loop.run(services.start(nats_url, only={"scheduler", "detector"}))
    try:
        with TestClient(create_app(api_settings)) as client:
            page = client.get("/ui", headers=operator)
            assert page.status_code == 200
            ids = elements_by_testid(page.text)
            assert ids["nodes-total"]["data-count"] == "3"
            assert "spares-error" in ids
            assert "guarantees-error" in ids
    finally:
        loop.run(services.stop())
        loop.close()


@pytest.fixture
def live_api(nats_proc: ServerProcess, redis_proc: ServerProcess) -> Iterator[str]:
    loop = BackgroundLoop()
    services = CannedServices()
    loop.run(services.start(nats_proc.url))
    cfg = ApiSettings(
        nats_url=nats_proc.url,
        redis_url=redis_proc.url,
        environment="test",
        operator_token=OPERATOR_TOKEN,
        rpc_timeout_s=2.0,
        log_json=False,
    )
    server = ServerThread(loop, create_app(cfg))
    yield server.start()
    server.stop()
    loop.run(services.stop())
    loop.close()


def dump_dom(url: str, profile: Path) -> str:
    """The DOM headless Chromium renders for ``url``."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium is not None
    result = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.skipif(
    not (shutil.which("chromium") or shutil.which("chromium-browser")),
    reason="Debian's chromium is not installed (apt-get install -y chromium)",
)
def test_chromium_shows_the_apis_numbers(live_api: str, tmp_path: Path) -> None:
    dom = dump_dom(f"{live_api}/ui/login?token={OPERATOR_TOKEN}", tmp_path / "profile")
    ids = elements_by_testid(dom)
    assert "fleet" in ids, dom[:2000]
    with httpx.Client(
        base_url=live_api, headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    ) as http:
        expected = expected_figures(lambda p: http.get(p).json())
    assert len(expected) > 10
    assert shown_figures(ids, set(expected)) == expected
    assert "<svg" in dom  # the gauges and charts are drawn
