"""Complete checkpoints on disk, without torch: what the launcher restarts from and the
agent loads (the writing and loading are ``torchrelay.agent._checkpoint``'s)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "torchrelay.json"
FORMAT = 1
STEP_DIR = re.compile(r"^step-(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: incomplete, corrupted, or of another job's shape."""


@dataclass(frozen=True)
class Found:
    """A complete checkpoint: its folder and its manifest."""

    path: Path
    steps: int
    world_size: int
    files: dict[str, str]


def step_dir(root: Path, steps: int) -> Path:
    """The folder of the checkpoint taken after ``steps`` steps (committed step steps-1)."""
    return root / f"step-{steps:08d}"


def read_manifest(path: Path) -> Found:
    """The manifest of the checkpoint at ``path``.

    Raises:
        CheckpointError: no manifest (incomplete), or one that does not describe ``path``.
    """
    match = STEP_DIR.match(path.name)
    try:
        data = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is incomplete: it has no {MANIFEST}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / MANIFEST} cannot be read: {exc}") from None
    if (
        not isinstance(data, dict)
        or data.get("format") != FORMAT
        or match is None
        or data.get("steps") != int(match[1])
        or not isinstance(data.get("files"), dict)
    ):
        raise CheckpointError(f"{path / MANIFEST} does not describe this checkpoint")
    return Found(path, int(data["steps"]), int(data["world_size"]), dict(data["files"]))


def complete_checkpoints(root: Path) -> list[Found]:
    """The complete checkpoints under ``root``, newest first (incomplete ones skipped)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            if STEP_DIR.match(entry.name) and entry.is_dir():
                with contextlib.suppress(CheckpointError):
                    found.append(read_manifest(entry))
    return sorted(found, key=lambda f: f.steps, reverse=True)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_files(found: Found) -> None:
    """Check every file the manifest lists against its sha256.

    Raises:
        CheckpointError: a file is missing or its bytes changed, named.
    """
    for name, digest in sorted(found.files.items()):
        path = found.path / name
        try:
            actual = sha256_of(path)
        except OSError as exc:
            raise CheckpointError(f"{path} cannot be read: {exc}") from None
        if actual != digest:
            raise CheckpointError(f"{path} is corrupted: its sha256 is not the manifest's")


def usable_checkpoint(root: Path) -> Found | None:
    """The newest complete checkpoint whose files pass their sha256 (what the agents load)."""
    for found in complete_checkpoints(root):
        try:
            verify_files(found)
        except CheckpointError:
            continue
        return found
    return None
