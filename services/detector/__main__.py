"""``python -m services.detector``: the central detector service; ``... agent``: a node agent.

python -m services.detector
python -m services.detector agent --node NAME [--backend nvml|amdsmi|sim|auto]
                                  [--interval S] [--scenario FILE]
"""

from __future__ import annotations

import gc
import sys


def _freeze_survivors(phase: str, info: dict[str, int]) -> None:
    """After a full collection, move what survived it out of the next ones.

    The detector's state (per-GPU windows, episodes, jobs) lives for hours and grows with the
    fleet: a full collection scanned 200,000+ such objects, a 30-200 ms stall of the event
    loop (and of any XID waiting in it). Frozen objects are still freed by reference count;
    only a reference cycle that was alive at the freeze and dies later is not reclaimed.
    """
    if phase == "stop" and info.get("generation") == 2:
        gc.freeze()


def main(argv: list[str]) -> int:
    """Run the service, or the node agent when the first argument is ``agent``."""
    if argv[:1] == ["agent"]:
        from services.detector.agent import main as agent_main

        return agent_main(argv[1:])
    from services.detector.service import DetectorSettings, setup
    from torchrelay.service import run_service

    # Everything imported so far lives as long as the process: keep the ~50,000 objects of
    # the libraries out of every full garbage collection (30+ ms each, a latency spike).
    gc.collect()
    gc.freeze()
    gc.callbacks.append(_freeze_survivors)
    run_service("detector", setup, DetectorSettings)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
