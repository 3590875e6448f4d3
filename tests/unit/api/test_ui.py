"""The operator dashboard: operator-only, and the numbers it shows are the API's numbers.

One test opens ``/ui`` in headless Chromium (Debian's ``chromium``) against a real server and
reads the figures out of the rendered DOM by their ``data-testid``.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.api.app import create_app
from services.api.settings import ApiSettings
from tests.unit.api.canned import OPERATOR_TOKEN, BackgroundLoop, CannedServices, ServerThread
from tests.unit.api.conftest import TestClient
from tests.unit.api.expect import elements_by_testid, expected_figures, shown_figures
from torchrelay.runtime import ServerProcess


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
