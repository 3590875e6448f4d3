"""The in-job agent: ``torchrelay.init()`` joins the job and returns its :class:`Job`.

See docs/design.md §4 for the semantics and docs of :class:`Job` for the training-loop API.
"""

from torchrelay.agent._data import StepBatchSampler
from torchrelay.agent._errors import AgentError, DivergenceError
from torchrelay.agent._job import Job, init
from torchrelay.agent._state import state_digest

__all__ = ["AgentError", "DivergenceError", "Job", "StepBatchSampler", "init", "state_digest"]
