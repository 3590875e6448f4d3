"""``python -m services.detector``: the central detector service; ``... agent``: a node agent.

python -m services.detector
python -m services.detector agent --node NAME [--backend nvml|amdsmi|sim|auto]
                                  [--interval S] [--scenario FILE]
"""

from __future__ import annotations

import gc
import sys


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
    run_service("detector", setup, DetectorSettings)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
