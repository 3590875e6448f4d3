"""The agent's settings from the environment the launcher gives every training process."""

from __future__ import annotations

import json
import os
from pathlib import Path

from torchrelay.agent._errors import AgentError
from torchrelay.agent._reducer import DEFAULT_BUCKET_MB


def env(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    if value is None:
        raise AgentError(
            f"{name} is not set: start training scripts with `torchrelay run "
            "--nproc N SCRIPT` (it sets the job's environment)"
        )
    return value


def nats_url() -> str:
    url = os.environ.get("NATS_URL")
    if url:
        return url
    home = Path(os.environ.get("TORCHRELAY_HOME", ".torchrelay"))
    try:
        return str(json.loads((home / "stack.json").read_text())["nats_url"])
    except (OSError, ValueError, KeyError) as exc:
        raise AgentError(
            "no torchrelay stack: run `torchrelay up --detach` or set NATS_URL"
        ) from exc


def verify_every_setting(given: int | None) -> int:
    """The divergence guard's period: ``given``, else ``TORCHRELAY_VERIFY_EVERY``, else 0."""
    if given is None:
        raw = os.environ.get("TORCHRELAY_VERIFY_EVERY", "").strip() or "0"
        try:
            given = int(raw)
        except ValueError:
            raise AgentError(
                f"TORCHRELAY_VERIFY_EVERY={raw!r} is not a whole number of steps; "
                "set it to N >= 1 to compare the ranks' state every N steps, or 0 for never"
            ) from None
    if isinstance(given, bool) or not isinstance(given, int) or given < 0:
        raise AgentError(
            f"verify_every={given!r}: give a whole number of steps >= 1 to compare the "
            "ranks' state every N steps, or 0 for never"
        )
    return given


def bucket_bytes_setting(overlap: bool | None, bucket_mb: float | None) -> int | None:
    """The overlap's bucket size in bytes, or None for one flat all-reduce after backward.

    ``overlap`` defaults to ``TORCHRELAY_OVERLAP`` (on unless "0"), ``bucket_mb`` to
    ``TORCHRELAY_BUCKET_MB`` (25, as DDP's ``bucket_cap_mb``).
    """
    if overlap is None:
        raw = os.environ.get("TORCHRELAY_OVERLAP", "1").strip().lower()
        if raw not in ("0", "1", "true", "false", "on", "off", ""):
            raise AgentError(
                f"TORCHRELAY_OVERLAP={raw!r}: set it to 1 (buckets during backward) or 0"
            )
        overlap = raw not in ("0", "false", "off")
    if not overlap:
        return None
    if bucket_mb is None:
        raw = os.environ.get("TORCHRELAY_BUCKET_MB", "").strip()
        try:
            bucket_mb = float(raw) if raw else DEFAULT_BUCKET_MB
        except ValueError:
            raise AgentError(f"TORCHRELAY_BUCKET_MB={raw!r} is not a number of megabytes") from None
    if isinstance(bucket_mb, bool) or not bucket_mb > 0:
        raise AgentError(f"bucket_mb={bucket_mb!r}: give a positive number of megabytes")
    return max(1, int(bucket_mb * 1024 * 1024))
