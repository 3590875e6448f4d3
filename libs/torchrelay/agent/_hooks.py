"""The agent's process hooks: reports and heartbeats to the control plane, the recovery
timeline, fencing, and the exit hooks that tell the launcher how this process ended."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, Literal, NoReturn

from torchrelay.agent._group import GRAVEYARD
from torchrelay.agent._member import Member
from torchrelay.contract import (
    EXIT_APPLICATION_ERROR,
    EXIT_FENCED,
    AgentReport,
    Heartbeat,
    ReportKind,
    Subjects,
    make_event_id,
)


class ProcessHooks(Member):
    """What the process tells the outside world, and how it leaves it."""

    def _run_warm_up(self, warm_up: Callable[[], object]) -> None:
        """Run a spare's warm-up (see :func:`init`); a failure is reported, never fatal."""
        started = time.perf_counter()
        try:
            warm_up()
        except Exception as exc:
            print(
                f"torchrelay: {self.member_id}: warm_up raised {type(exc).__name__}: {exc}; "
                "the spare serves without warm-up",
                file=sys.stderr,
                flush=True,
            )
            self._mark("warm_up_failed", error=repr(exc))
            return
        self._mark("warmed_up", ms=round(1000 * (time.perf_counter() - started), 1))

    def _mark(self, event: str, **fields: Any) -> None:
        """Append a timed event to ``$TORCHRELAY_AGENT_TIMELINE/<member>.timeline``, if set.

        The recovery path's phases (generation seen, group formed, state synced, resumed)
        in wall-clock time, to line up with the services' logs when a stall is analysed.
        """
        if self._timeline is None:
            return
        line = json.dumps({"t": time.time(), "event": event, **fields})
        try:
            with self._timeline.open("a") as out:
                out.write(line + "\n")
        except OSError:
            self._timeline = None  # a broken debug aid must never hurt training

    def _make_report(self, kind: ReportKind, *, event_id: str, **fields: Any) -> AgentReport:
        fields.setdefault("rank", self._rank)
        return AgentReport(
            event_id=event_id,
            source=f"agent:{self.member_id}",
            job_id=self.job_id,
            member_id=self.member_id,
            kind=kind,
            role=self.role,
            node=self.node,
            gpu=self.gpu,
            pid=os.getpid(),
            cluster=self.cluster,
            **fields,
        )

    def _report(self, kind: ReportKind, *, event_id: str, **fields: Any) -> None:
        self._net.publish(
            self._make_report(kind, event_id=event_id, **fields), Subjects.agent_report(self.job_id)
        )

    def _heartbeat(self, kind: Literal["step", "liveness"]) -> None:
        beat = Heartbeat(
            event_id=make_event_id("hb", self.member_id, kind, time.time_ns()),
            source=f"agent:{self.member_id}",
            job_id=self.job_id,
            member_id=self.member_id,
            rank=self._rank,
            generation=self._generation_number(),
            step=self._committed,
            step_time_s=self._step_time,
            kind=kind,
            node=self.node,
            gpu=self.gpu,
            pid=os.getpid(),
            cluster=self.cluster,
        )
        self._net.publish_core(Subjects.heartbeat(self.job_id), beat)

    def _liveness(self) -> None:
        self._heartbeat("liveness")

    def _fenced_report(self, why: str) -> AgentReport:
        return self._make_report(
            ReportKind.FENCED,
            generation=self._generation_number(),
            error=why,
            step=self._committed,
            event_id=make_event_id("fenced", self.member_id, self._generation_number()),
        )

    def _fence(self, why: str) -> NoReturn:
        """Exit with EXIT_FENCED: another process holds our rank; nothing more is committed."""
        self._exiting = True
        self._net.publish(self._fenced_report(why), Subjects.agent_report(self.job_id))
        self._net.flush(2.0)
        print(f"torchrelay: {self.member_id} fenced: {why}", file=sys.stderr, flush=True)
        _hard_exit(EXIT_FENCED)

    async def _fence_from_loop(self, why: str) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                self._net.bus.publish(self._fenced_report(why), Subjects.agent_report(self.job_id)),
                2.0,
            )
        print(f"torchrelay: {self.member_id} fenced: {why}", file=sys.stderr, flush=True)
        _hard_exit(EXIT_FENCED)

    def _write_exit_record(self, record: dict[str, Any]) -> None:
        """``<RUN_DIR>/<member_id>.exit.json``: what the launcher reads when we exit."""
        with contextlib.suppress(OSError):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / f"{self.member_id}.exit.json").write_text(json.dumps(record))

    def _install_exit_hooks(self) -> None:
        previous = sys.excepthook

        def _hook(
            exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
        ) -> None:
            if issubclass(exc_type, KeyboardInterrupt):
                previous(exc_type, exc, tb)
                _hard_exit(130)
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            self._write_exit_record({"kind": "application_error", "error": text[-8000:]})
            with contextlib.suppress(Exception):
                self._report(
                    ReportKind.APPLICATION_ERROR,
                    generation=self._generation_number(),
                    step=self._committed,
                    error=text[-8000:],
                    event_id=make_event_id("application_error", self.member_id),
                )
                self._net.flush(3.0)
            previous(exc_type, exc, tb)
            # Exit now: abandoned groups and the net thread must not delay the exit.
            _hard_exit(EXIT_APPLICATION_ERROR)

        sys.excepthook = _hook
        previous_exit = sys.exit

        def _exit(status: str | int | None = None) -> NoReturn:
            self._exit_status = _status_code(status)
            previous_exit(status)

        sys.exit = _exit
        atexit.register(self._at_exit)
        if (
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
            and threading.current_thread() is threading.main_thread()
        ):
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """Stopped by the launcher (a checkpoint restart, the job's end): say which step
        was committed, so that a restart knows the steps it loses, then die of the signal
        as before. A script's own SIGTERM handler is left alone (then nothing is said)."""
        del frame
        if not self._finished:
            self._write_exit_record({"kind": "stopped", "committed_step": self._committed})
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _at_exit(self) -> None:
        """End a process that left a group mid-collective without running C++ teardown.

        Such a group's pending operation fails when its peers exit, and gloo raises that
        error on its own thread; during the interpreter's teardown this aborts the process
        (SIGABRT), which the launcher would count as a lost worker after a clean finish.
        """
        if GRAVEYARD.in_flight:
            logging.shutdown()
            _hard_exit(self._exit_status)


def _status_code(status: object) -> int:
    """The process exit code ``sys.exit(status)`` produces."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status
    return 1


def _hard_exit(code: int) -> NoReturn:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
