"""The death latch: a child holding it is reported dying, with its exit status, while it is
still unreaped; children that exit cleanly or never hold it are not reported."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from torchrelay import deathlatch
from torchrelay.deathlatch import DeathLatch, exit_status, hold_from_env

pytestmark = pytest.mark.skipif(
    DeathLatch.create() is None, reason="no robust process-shared mutexes on this platform"
)

# The child holds the latch, says so, then does what it is told on stdin.
CHILD = """
import os, sys, threading
from torchrelay.deathlatch import hold_from_env
where = sys.argv[1]
if where == "thread":
    held = []
    t = threading.Thread(target=lambda: held.append(hold_from_env()))
    t.start(); t.join()
    print("held" if held[0] else "not held", flush=True)
elif where == "never":
    print("not held", flush=True)
else:
    print("held" if hold_from_env() else "not held", flush=True)
    print(os.environ.get("TORCHRELAY_DEATH_LATCH_FD", "gone"), flush=True)
what = sys.stdin.readline().strip()
if what.startswith("exit"):
    os._exit(int(what.split()[1]))
if what == "sleep":
    import time; time.sleep(60)
"""


class Spawned:
    def __init__(self, where: str = "main") -> None:
        self.latch = DeathLatch.create()
        assert self.latch is not None
        assert self.latch.fd is not None
        env = {**os.environ, **self.latch.child_env()}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, where],
            env=env,
            pass_fds=(self.latch.fd,),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.latch.spawned()
        self.statuses: list[int] = []
        self.unreaped_at_call: list[bool] = []
        self.called = threading.Event()
        self.latch.watch(self.proc.pid, self._on_dying)
        assert self.proc.stdout is not None
        self.first_line = self.proc.stdout.readline().strip()

    def _on_dying(self, status: int) -> None:
        # The test never reaps before this is called: the child is at most a zombie.
        self.unreaped_at_call.append(os.path.exists(f"/proc/{self.proc.pid}/stat"))
        self.statuses.append(status)
        self.called.set()

    def tell(self, what: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()


@pytest.fixture
def spawned() -> Iterator[list[Spawned]]:
    made: list[Spawned] = []
    yield made
    for s in made:
        if s.proc.poll() is None:
            s.proc.kill()
        s.proc.wait()
        assert s.latch is not None
        s.latch.close()


def test_a_sigkilled_child_is_reported_before_it_is_reaped(spawned: list[Spawned]) -> None:
    s = Spawned()
    spawned.append(s)
    assert s.first_line == "held"
    assert s.proc.stdout is not None
    assert s.proc.stdout.readline().strip() == "gone"  # its own children will not try
    s.tell("sleep")
    os.kill(s.proc.pid, signal.SIGKILL)
    assert s.called.wait(30), "the latch never reported the killed child"
    assert s.statuses == [-signal.SIGKILL]
    assert s.unreaped_at_call == [True]
    assert s.proc.wait(30) == -signal.SIGKILL


def test_a_nonzero_exit_is_reported_with_its_code(spawned: list[Spawned]) -> None:
    s = Spawned()
    spawned.append(s)
    assert s.first_line == "held"
    s.tell("exit 3")
    assert s.called.wait(30)
    assert s.statuses == [3]
    assert s.proc.wait(30) == 3


def test_a_clean_exit_is_not_reported(spawned: list[Spawned]) -> None:
    s = Spawned()
    spawned.append(s)
    s.tell("exit 0")
    assert s.proc.wait(30) == 0
    assert not s.called.wait(0.5)


@pytest.mark.parametrize("where", ["never", "thread"])
def test_a_child_that_does_not_hold_it_from_the_main_thread_is_left_to_waitpid(
    spawned: list[Spawned], where: str
) -> None:
    s = Spawned(where)
    spawned.append(s)
    assert s.first_line == "not held"
    s.tell("exit 4")
    assert s.proc.wait(30) == 4
    assert s.latch is not None
    s.latch.close()  # what the launcher does once it reaped the child: the watcher ends
    assert s.latch._thread is not None
    s.latch._thread.join(5)
    assert not s.latch._thread.is_alive()
    assert not s.called.is_set()


def test_hold_from_env_refuses_anything_but_a_latch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(deathlatch.ENV, raising=False)
    assert hold_from_env() is False  # not launched by torchrelay run
    monkeypatch.setenv(deathlatch.ENV, "not-a-number")
    assert hold_from_env() is False
    r, w = os.pipe()
    try:
        monkeypatch.setenv(deathlatch.ENV, str(r))  # an open fd, but not the launcher's memfd
        assert hold_from_env() is False
    finally:
        os.close(r)
        os.close(w)
    assert deathlatch.ENV not in os.environ
    assert deathlatch._held == []


def test_exit_status_of_a_live_process_is_none() -> None:
    assert exit_status(os.getpid()) is None
    assert exit_status(2**22 + 12345) is None  # no such process
