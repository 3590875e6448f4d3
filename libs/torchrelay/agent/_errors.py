"""The agent's errors: what a training script sees when the agent cannot go on."""

from __future__ import annotations


class AgentError(RuntimeError):
    """The agent cannot run: the message says what is missing and how to fix it."""


class DivergenceError(AgentError):
    """The divergence guard found ranks whose tracked state differs (``verify_every``)."""
