"""torchrelay: keep PyTorch training running through GPU failures by live migration.

The public surface for training scripts is :func:`init` and :class:`Job`; everything else
is the control plane's shared library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from torchrelay.agent import Job


def init(**kwargs: Any) -> Job:
    """Join the job this process was launched into (a spare blocks until it takes a rank).

    ``warm_up=`` (a callable) is run once by a hot spare before it waits; see
    :func:`torchrelay.agent.init` for it and the other keyword arguments.
    """
    from torchrelay.agent import init as _init

    return _init(**kwargs)


def __getattr__(name: str) -> Any:
    if name == "Job":
        from torchrelay.agent import Job

        return Job
    raise AttributeError(f"module 'torchrelay' has no attribute {name!r}")


__all__ = ["Job", "__version__", "init"]
