"""``torchrelay run``: start a job's workers and hot spares on simulated slots and supervise them.

The launcher is the job's hands on this machine: it spawns N workers
and S hot spares as subprocesses (``--nodes K`` spreads them over K simulated nodes),
registers the job and its spares, reports every child's exit (a lost rank's as soon as it
starts dying: ``deathlatch``), answers fencing orders, cold-spare spawns and pid look-ups on
NATS, forwards Ctrl-C/SIGTERM to the whole job, and exits 0 when every rank of the newest
generation has finished.

``_setup`` holds what comes before any process (environment, credentials, slots, exit codes),
``_launcher`` the supervising class, ``_args`` the command line.
"""

from torchrelay.launcher._args import cmd_run, options_from_args
from torchrelay.launcher._launcher import Launcher
from torchrelay.launcher._setup import (
    EXIT_USAGE,
    GIVE_UP_MARGIN_S,
    PROCESS_DEFAULTS,
    STACK_ONLY_ENV,
    STOP_GRACE_S,
    Child,
    LauncherError,
    Options,
    Outcome,
    classify_exit,
    describe_exit,
    prepare_run_dir,
    register_hot_spare,
    resolve_credentials,
    resolve_nats_url,
    run_as_ids,
    slot_of,
    with_process_defaults,
)

__all__ = [
    "EXIT_USAGE",
    "GIVE_UP_MARGIN_S",
    "PROCESS_DEFAULTS",
    "STACK_ONLY_ENV",
    "STOP_GRACE_S",
    "Child",
    "Launcher",
    "LauncherError",
    "Options",
    "Outcome",
    "classify_exit",
    "cmd_run",
    "describe_exit",
    "options_from_args",
    "prepare_run_dir",
    "register_hot_spare",
    "resolve_credentials",
    "resolve_nats_url",
    "run_as_ids",
    "slot_of",
    "with_process_defaults",
]
