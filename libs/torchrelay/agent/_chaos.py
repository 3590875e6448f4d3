"""Faults injected at points inside the agent that a training script cannot reach.

For conformance and chaos tests only: ``TORCHRELAY_CHAOS_POINT="POINT:MEMBER:STEP[:SIGNAL]"``
makes member ``MEMBER`` send itself ``SIGNAL`` (``KILL``, the default, or ``STOP``) once, at
``POINT`` of step ``STEP``:

- ``allreduce``: the step's gradient all-reduce is posted and in flight;
- ``send_state``: a recovery source has posted every send of its state to the ranks below it
  (``STEP`` is the step the job resumes at);
- ``recv_state``: a rank has the header of the state it receives and has posted the receives
  of the tensors;
- ``optimizer``: a sharded step's ``reduce_gradients`` returns True (its peers go on into
  the optimizer step and its collectives);
- ``commit``: a sharded step's optimizer step is done and its commit agreement is next;
- ``checkpoint``: a rank exchanged its checkpoint plan and has not written its part
  (``STEP`` is the checkpoint's number of steps).

Points a script reaches itself (forward, backward, the optimizer step, between steps, a
spare's warm-up) are left to the script.
"""

from __future__ import annotations

import os
import signal

POINTS = ("allreduce", "send_state", "recv_state", "optimizer", "commit", "checkpoint")
ENV = "TORCHRELAY_CHAOS_POINT"


class ChaosPoint:
    """The fault this process injects, if any (parsed once from :data:`ENV`)."""

    def __init__(self, spec: str | None, member_id: str) -> None:
        self.point: str | None = None
        self._fired = False
        if not spec:
            return
        parts = spec.split(":")
        if len(parts) not in (3, 4) or parts[0] not in POINTS or not parts[2].isdigit():
            raise ValueError(
                f"{ENV}={spec!r}: expected POINT:MEMBER:STEP[:KILL|STOP] with POINT one of "
                f"{', '.join(POINTS)}"
            )
        name = parts[3] if len(parts) == 4 else "KILL"
        if name not in ("KILL", "STOP"):
            raise ValueError(f"{ENV}={spec!r}: the signal must be KILL or STOP, not {name!r}")
        if parts[1] != member_id:
            return
        self.point, self.step = parts[0], int(parts[2])
        self.signal = signal.SIGKILL if name == "KILL" else signal.SIGSTOP

    def hit(self, point: str, step: int) -> None:
        """Send the signal to this process if ``point`` of ``step`` is the chosen one."""
        if self.point == point and self.step == step and not self._fired:
            self._fired = True
            os.kill(os.getpid(), self.signal)
