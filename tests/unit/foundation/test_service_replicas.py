"""``torchrelay up --replicas R``: the setting, and a bad value refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchrelay.cli import main
from torchrelay.stack import instance_key, service_replicas


@pytest.mark.parametrize(("raw", "count"), [(None, 1), ("", 1), ("1", 1), ("2", 2), ("5", 5)])
def test_replicas_parse(raw: str | None, count: int) -> None:
    assert service_replicas(raw) == count


@pytest.mark.parametrize("raw", ["0", "6", "-1", "two", "1.5"])
def test_bad_replicas_are_refused_naming_the_flag(raw: str) -> None:
    with pytest.raises(ValueError, match="--replicas"):
        service_replicas(raw)


def test_each_process_has_its_own_name() -> None:
    assert instance_key("scheduler", 0) == "scheduler"
    assert instance_key("scheduler", 1) == "scheduler.1"


def test_up_refuses_a_bad_count_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    assert main(["up", "--state-dir", str(state), "--replicas", "9"]) == 2
    assert "1 to 5" in capsys.readouterr().err
    assert not (state / "stack.json").exists()
