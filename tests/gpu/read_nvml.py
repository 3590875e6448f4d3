"""Read every signal the NVML backend knows from the real NVIDIA GPUs of this machine.

Run it where a GPU and its driver are at hand (not part of ``make test``)::

    python tests/gpu/read_nvml.py            # one read of every GPU, then 2 s of events
    python tests/gpu/read_nvml.py --events 30

It prints each GPU's sample field by field (what the detector will see), the fields the
device does not support, the raw field values behind them, and any XID / critical event
delivered by ``nvmlEventSetWait_v2`` while it waits. It exits 0 when every GPU was read, 2
when NVML could not load (and says why), 1 when a GPU reported itself lost.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libs"))

from torchrelay.contract import TelemetrySample
from torchrelay.telemetry import BackendUnavailable
from torchrelay.telemetry.nvml import NvmlBackend


def _print_sample(s: TelemetrySample, unsupported: list[str]) -> None:
    print(f"GPU {s.gpu}: {s.gpu_model}")
    data = s.model_dump(
        mode="json", exclude={"cluster", "node", "gpu", "ts", "backend", "gpu_model", "extra"}
    )
    for key, value in data.items():
        print(f"  {key:<28} {'-' if value is None else value}")
    for key, value in sorted(s.extra.items()):
        print(f"  extra.{key:<22} {value}")
    if unsupported:
        print(f"  not supported here: {', '.join(sorted(unsupported))}")


def main(argv: list[str]) -> int:
    """Read and print; see the module docstring for exit codes."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=float, default=2.0, help="seconds to wait for events")
    p.add_argument("--json", action="store_true", help="print samples as JSON lines")
    args = p.parse_args(argv)
    try:
        backend = NvmlBackend("local", "this-node")
    except BackendUnavailable as exc:
        print(f"NVML could not load: {exc.reason}", file=sys.stderr)
        return 2
    try:
        started = time.perf_counter()
        samples = backend.read()
        took = time.perf_counter() - started
        print(
            f"NVML: {backend.gpu_count()} GPU(s); one read of every signal took "
            f"{took * 1000:.1f} ms"
        )
        for s in samples:
            unsupported = [name for gpu, name in backend._unsupported if gpu == s.gpu]
            if args.json:
                print(json.dumps({**s.model_dump(mode="json"), "unsupported": unsupported}))
            else:
                _print_sample(s, unsupported)
        started = time.perf_counter()
        backend.read()
        print(
            f"second read (unsupported fields skipped): "
            f"{(time.perf_counter() - started) * 1000:.1f} ms"
        )
        print(f"waiting {args.events:g} s for XID / critical events ...")
        deadline = time.monotonic() + args.events
        while time.monotonic() < deadline:
            for ev in backend.wait_events(min(1.0, max(0.01, deadline - time.monotonic()))):
                print("  event:", ev.model_dump_json(exclude_none=True))
        lost = [s.gpu for s in samples if s.gpu_lost]
        if lost:
            print(f"GPU(s) reported lost: {lost}", file=sys.stderr)
            return 1
        return 0
    finally:
        backend.close()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
