"""The CLI's read commands against a running API (uvicorn on a free port, real NATS behind)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.api.app import create_app
from services.api.settings import ApiSettings
from tests.unit.api.canned import OPERATOR_TOKEN, BackgroundLoop, CannedServices, ServerThread
from torchrelay.cli import main
from torchrelay.runtime import ServerProcess, free_port


@pytest.fixture(scope="module")
def api(
    nats_proc: ServerProcess, redis_proc: ServerProcess
) -> Iterator[tuple[str, CannedServices]]:
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
    yield server.start(), services
    server.stop()
    loop.run(services.stop())
    loop.close()


@pytest.fixture
def env(
    api: tuple[str, CannedServices], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> CannedServices:
    monkeypatch.setenv("TORCHRELAY_API_URL", api[0])
    monkeypatch.setenv("TORCHRELAY_TOKEN", OPERATOR_TOKEN)
    monkeypatch.setenv("TORCHRELAY_HOME", str(tmp_path))
    return api[1]


def test_status_json_lists_jobs_nodes_and_spares(
    env: CannedServices, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [j["job_id"] for j in data["jobs"]] == ["job-a", "job-b"]
    assert {n["node"] for n in data["nodes"]} == {"node-1", "node-2", "node-3"}
    assert sum(d["available"] for d in data["spares"]) == 2
    assert data["clusters"][0]["spares_available"] == 2


def test_status_table(env: CannedServices, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "job-a" in out
    assert "unhealthy" in out
    assert "nvl-1" in out
    assert "below floor" in out


def test_incidents_filter_by_job(env: CannedServices, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["incidents", "--job", "job-a", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [i["incident_id"] for i in rows] == ["inc-a1", "inc-a2"]
    assert env.last("scheduler", "incident_list")["job_id"] == "job-a"
    assert main(["incidents"]) == 0
    out = capsys.readouterr().out
    assert "inc-b1" in out
    assert "checkpoint_restart" in out


def test_credits_show_guarantee_and_credits(
    env: CannedServices, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["credits", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by_id = {c["contract_id"]: c for c in data["contracts"]}
    assert by_id["ctr-a"]["guarantee"]["ratio"] == 0.5
    assert [c["credit_id"] for c in data["credits"]] == ["cr-a"]
    assert main(["credits", "--contract", "ctr-a"]) == 0
    out = capsys.readouterr().out
    assert "50.0%" in out
    assert "NO" in out
    assert "250000 USD" in out


def test_export_to_file_and_stdout(
    env: CannedServices, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "focus.csv"
    assert main(["export", "--period", "2026-11", "-o", str(target)]) == 0
    assert target.read_text().startswith("BilledCost,")
    assert main(["export", "--period", "2026-11", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["ChargeCategory"] == "Credit"
    assert main(["export", "--period", "2026-13"]) == 1
    assert "period" in capsys.readouterr().err


def test_drain_and_ledger_verify(env: CannedServices, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["drain", "--node", "node-2"]) == 0
    assert "node-2" in capsys.readouterr().out
    assert env.last("scheduler", "drain")["node"] == "node-2"
    assert main(["ledger", "verify"]) == 0
    assert "ledger ok: 3 entries" in capsys.readouterr().out


def test_stack_json_is_the_fallback(
    api: tuple[str, CannedServices],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("TORCHRELAY_API_URL", raising=False)
    monkeypatch.delenv("TORCHRELAY_TOKEN", raising=False)
    monkeypatch.setenv("TORCHRELAY_HOME", str(tmp_path))
    (tmp_path / "stack.json").write_text(
        json.dumps({"api_url": api[0], "operator_token": OPERATOR_TOKEN})
    )
    assert main(["incidents", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3


def test_errors_name_what_to_do(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    api: tuple[str, CannedServices],
) -> None:
    monkeypatch.setenv("TORCHRELAY_HOME", str(tmp_path))
    monkeypatch.delenv("TORCHRELAY_API_URL", raising=False)
    monkeypatch.delenv("TORCHRELAY_TOKEN", raising=False)
    assert main(["status"]) == 2
    assert "TORCHRELAY_API_URL" in capsys.readouterr().err
    monkeypatch.setenv("TORCHRELAY_API_URL", f"http://127.0.0.1:{free_port()}")
    assert main(["incidents"]) == 3
    assert "cannot be reached" in capsys.readouterr().err
    monkeypatch.setenv("TORCHRELAY_API_URL", api[0])
    monkeypatch.setenv("TORCHRELAY_TOKEN", "tr_wrong")
    assert main(["incidents"]) == 2
    assert "TORCHRELAY_TOKEN" in capsys.readouterr().err


def test_a_tenant_token_sees_only_its_own_jobs(
    api: tuple[str, CannedServices],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    r = httpx.post(
        f"{api[0]}/v1/tokens",
        json={"scope": "tenant", "tenant": "globex"},
        headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"},
    )
    monkeypatch.setenv("TORCHRELAY_API_URL", api[0])
    monkeypatch.setenv("TORCHRELAY_TOKEN", r.json()["token"])
    monkeypatch.setenv("TORCHRELAY_HOME", str(tmp_path))
    assert main(["status", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [j["job_id"] for j in data["jobs"]] == ["job-b"]
    assert "nodes" not in data  # operator-only: left out, not an error
    assert main(["incidents", "--json"]) == 0
    assert {i["tenant"] for i in json.loads(capsys.readouterr().out)} == {"globex"}
    assert main(["drain", "--node", "node-1"]) == 2
    assert "operator" in capsys.readouterr().err
