"""The wire contract: envelopes, validation that names the field, stable ids, proto drift."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from pydantic import ValidationError

import torchrelay
from torchrelay import contract
from torchrelay.contract import (
    EVENT_SUBJECTS,
    FaultAction,
    FaultDetected,
    FaultKind,
    Heartbeat,
    Incident,
    Severity,
    Subjects,
    make_event_id,
    model_for_subject,
)

ROOT = Path(__file__).resolve().parents[3]


def test_event_ids_are_deterministic_and_distinct() -> None:
    assert make_event_id("fault", "n1", 0, "xid79") == make_event_id("fault", "n1", 0, "xid79")
    assert make_event_id("fault", "n1", 0) != make_event_id("fault", "n10")
    assert make_event_id("a", "b") != make_event_id("ab")


def test_timestamps_are_normalised_to_utc_and_naive_ones_refused() -> None:
    local = datetime(2026, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    fault = FaultDetected(
        event_id="e",
        source="t",
        fault_id="f",
        cluster="c",
        node="n",
        kind=FaultKind.GPU_LOST,
        severity=Severity.FATAL,
        action=FaultAction.MIGRATE_NOW,
        occurred_at=local,
    )
    assert fault.occurred_at == datetime(2026, 1, 1, 10, tzinfo=UTC)
    with pytest.raises(ValidationError, match="timezone"):
        FaultDetected(
            event_id="e",
            source="t",
            fault_id="f",
            cluster="c",
            node="n",
            kind=FaultKind.GPU_LOST,
            severity=Severity.FATAL,
            action=FaultAction.MIGRATE_NOW,
            occurred_at=datetime(2026, 1, 1),
        )


def test_unknown_fields_are_accepted_and_invalid_ones_named() -> None:
    raw = (
        '{"event_id":"e","source":"s","job_id":"j","member_id":"m","generation":1,'
        '"step":3,"node":"n","gpu":0,"pid":1,"from_the_future":true}'
    )
    hb = Heartbeat.model_validate_json(raw)
    assert hb.step == 3
    with pytest.raises(ValidationError) as err:
        Heartbeat.model_validate_json(raw.replace('"gpu":0', '"gpu":-1'))
    assert err.value.errors()[0]["loc"] == ("gpu",)


def test_events_are_frozen() -> None:
    hb = Heartbeat(
        event_id="e",
        source="s",
        job_id="j",
        member_id="m",
        generation=1,
        step=1,
        node="n",
        gpu=0,
        pid=1,
    )
    with pytest.raises(ValidationError):
        hb.step = 2  # type: ignore[misc]


def test_incident_fields_match_interfaces() -> None:
    documented = [
        "incident_id",
        "tenant",
        "job_id",
        "rank",
        "node",
        "gpu",
        "fault_kind",
        "severity",
        "detected_at",
        "resolved_at",
        "resolution",
        "stall_ms",
        "lost_steps",
        "bytes_moved",
        "generation_before",
        "generation_after",
    ]
    assert set(documented) <= set(Incident.model_fields)
    assert {r.value for r in contract.Resolution} == {
        "open",
        "migrated_live",
        "migrated_proactive",
        "checkpoint_restart",
        "shrunk",
        "manual",
        "lost",
        "excluded",
    }


def test_every_stream_subject_maps_back_to_its_model() -> None:
    for model, subject in EVENT_SUBJECTS.items():
        if subject.startswith("tr.evt.") and "{" not in subject:
            assert model_for_subject(subject) is model
    assert model_for_subject(Subjects.agent_report("job1")) is contract.AgentReport
    assert model_for_subject("tr.evt.nonsense") is None


def test_public_surface_is_pinned() -> None:
    assert set(torchrelay.__all__) == {"Job", "__version__", "init"}


def test_proto_is_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.protogen", str(ROOT / "proto"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
