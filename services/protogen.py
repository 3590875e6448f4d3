"""Write or check ``proto/``: the contract's schemas and AsyncAPI document, and the portal
API's OpenAPI document.

``python -m services.protogen proto`` (``make proto``) writes the files and removes stale
ones; ``--check`` exits 1 when the committed files differ from what the code generates (the
drift tests use it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.api.app import openapi_document
from torchrelay import protogen


def generate() -> dict[str, str]:
    """Relative path → file content for everything under ``proto/``."""
    files = protogen.generate()
    files["openapi.json"] = protogen.dump(openapi_document())
    return files


def main(argv: list[str] | None = None) -> int:
    """Write or check ``proto/``."""
    parser = argparse.ArgumentParser(prog="python -m services.protogen")
    parser.add_argument("out", nargs="?", default="proto")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    root = Path(args.out)
    files = generate()
    stale = []
    for rel, text in files.items():
        path = root / rel
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(rel)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if not args.check:
        known = set(files)
        for path in root.rglob("*.json"):
            if str(path.relative_to(root)) not in known:
                path.unlink()
    if stale:
        print(
            f"proto/ is stale ({len(stale)} files, e.g. {stale[0]}); run `make proto`",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
