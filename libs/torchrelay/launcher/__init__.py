"""``torchrelay run``: start a host's workers and hot spares and supervise them.

The launcher is the job's hands on its host: it spawns the host's workers and hot spares
as subprocesses on the host's slots (across hosts one launcher per host, meeting through
the scheduler's rendezvous; the one-host shortcut ``--nodes K`` spreads them over K
simulated nodes),
registers the job and its spares, reports every child's exit (a lost rank's as soon as it
starts dying: ``deathlatch``), answers fencing orders, cold-spare spawns and pid look-ups on
NATS, forwards Ctrl-C/SIGTERM to the whole job, and exits 0 when every rank of the newest
generation has finished (exit 2: bad arguments or no control plane; 3: the rendezvous
refused this host).

``_setup`` holds what comes before any process (environment, credentials, slots, exit codes),
``_launcher`` the supervising class, ``_args`` the command line.
"""

from torchrelay.launcher._args import cmd_run, options_from_args
from torchrelay.launcher._launcher import Launcher
from torchrelay.launcher._setup import (
    EXIT_HOST_REFUSED,
    EXIT_USAGE,
    GIVE_UP_MARGIN_S,
    PROCESS_DEFAULTS,
    STACK_ONLY_ENV,
    STOP_GRACE_S,
    Child,
    HostRefused,
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
    "EXIT_HOST_REFUSED",
    "EXIT_USAGE",
    "GIVE_UP_MARGIN_S",
    "PROCESS_DEFAULTS",
    "STACK_ONLY_ENV",
    "STOP_GRACE_S",
    "Child",
    "HostRefused",
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
