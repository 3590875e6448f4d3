"""The training-script API of docs/interfaces.md stays importable under its promised names."""

from __future__ import annotations

import inspect

import pytest

import torchrelay
import torchrelay.agent


def test_public_surface_is_pinned() -> None:
    assert sorted(torchrelay.agent.__all__) == [
        "AgentError",
        "DivergenceError",
        "Job",
        "StepBatchSampler",
        "init",
        "state_digest",
    ]
    assert torchrelay.Job is torchrelay.agent.Job
    for name in ("track", "batches", "step", "reduce_gradients", "sampler", "finish"):
        assert callable(getattr(torchrelay.Job, name))
    for prop in ("rank", "world_size", "generation", "committed_step"):
        assert isinstance(inspect.getattr_static(torchrelay.Job, prop), property)
    params = inspect.signature(torchrelay.Job.batches).parameters
    assert list(params)[1:4] == ["dataset", "batch_size", "max_steps"]
    assert all(
        params[k].kind is inspect.Parameter.KEYWORD_ONLY
        for k in ("seed", "shuffle", "collate_fn", "accumulate")
    )


def test_a_warm_up_that_is_not_callable_is_refused_before_joining() -> None:
    with pytest.raises(TypeError, match=r"warm_up=\.\.\.\) needs a callable, got 'step'"):
        torchrelay.init(warm_up="step")
