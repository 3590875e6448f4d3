"""The step's gradient all-reduce: one flat buffer, or buckets launched during backward.

Bucketed mode is DDP's overlap: the parameters are laid out in buckets (reverse order of
the optimizers' parameters, which is roughly the order backward produces their gradients,
at most ``bucket_bytes`` each), and a post-accumulate-grad hook on every parameter launches
a bucket's all-reduce as soon as all its gradients are final, while backward goes on. The
buckets are launched strictly in order on every rank (the group matches collectives by
their order), and the last one, which carries the boundary flag, only when the step is
reduced.

Exactness: the all-reduce of a buffer sums in an order set by the buffer's size and the
world size, so a repeated all-reduce (after a failure) uses the same layout as the first
try, launched after backward instead of during it: the same bits either way. The buckets
are copies; a failed collective never touches the parameters' own gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from torchrelay.agent._errors import AgentError
from torchrelay.agent._grads import flatten_grads, unflatten_grads

DEFAULT_BUCKET_MB = 25.0


class OverlapMisuse(AgentError):
    """The loop changed a gradient after its bucket was launched."""


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    last: bool
    buffer: torch.Tensor | None = None
    waiting: int = 0  # gradients not final yet in the armed backward


@dataclass
class _Armed:
    """A backward whose hooks may launch buckets into ``pg``."""

    pg: Any
    may_launch: Callable[[], bool]  # False once the group is stale or state still arrives
    works: list[Any] = field(default_factory=list)
    launched: int = 0  # buckets launched, in order
    error: BaseException | None = None
    seen: set[int] = field(default_factory=set)  # parameters whose gradient was final
    twice: str | None = None  # a gradient that changed after it was final


def layout(
    params: list[torch.nn.Parameter], bucket_bytes: int | None
) -> list[list[torch.nn.Parameter]]:
    """The buckets of ``params``: one bucket when ``bucket_bytes`` is None, else reverse
    order, a new bucket at ``bucket_bytes`` or where the dtype changes."""
    if bucket_bytes is None or not params:
        return [list(params)]
    buckets: list[list[torch.nn.Parameter]] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > bucket_bytes or p.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    buckets.append(current)
    return buckets


class Reducer:
    """The gradients of one set of parameters, all-reduced as their mean over the group."""

    def __init__(self, device: torch.device, bucket_bytes: int | None) -> None:
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.params: list[torch.nn.Parameter] = []
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        self._hooks: list[Any] = []
        self._armed: _Armed | None = None

    @property
    def overlap(self) -> bool:
        return self.bucket_bytes is not None

    def set_params(self, params: list[torch.nn.Parameter]) -> None:
        """Use ``params`` (the step's optimizers' trainable parameters, in their order)."""
        if len(params) == len(self.params) and all(
            a is b for a, b in zip(params, self.params, strict=True)
        ):
            return
        self.disarm()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.params = params
        groups = layout(params, self.bucket_bytes)
        self._buckets = [_Bucket(g, i == len(groups) - 1) for i, g in enumerate(groups)]
        self._bucket_of = {id(p): i for i, b in enumerate(self._buckets) for p in b.params}
        if self.overlap and len(self._buckets) > 1:
            for p in params:
                hook = p.register_post_accumulate_grad_hook  # untyped in torch
                self._hooks.append(hook(self._on_grad))  # type: ignore[no-untyped-call]

    def arm(self, pg: Any, may_launch: Callable[[], bool]) -> None:
        """The next backward is the step's last: its hooks launch the buckets into ``pg``."""
        self.disarm()
        if not self._hooks:
            return
        for b in self._buckets:
            b.waiting = len(b.params)
        self._armed = _Armed(pg, may_launch)

    def disarm(self) -> None:
        """Stop launching; what was launched is forgotten (the caller keeps or waits it)."""
        self._armed = None

    def _on_grad(self, param: torch.Tensor) -> None:
        """Autograd hook: ``param``'s gradient is final for this backward."""
        armed = self._armed
        if armed is None:
            return
        index = self._bucket_of.get(id(param))
        if index is None:
            return
        if id(param) in armed.seen:
            # A second backward in the step's last micro-batch: the first one's buckets may
            # be gone already, and the sum would then differ from a repeated step's.
            armed.twice = armed.twice or f"a parameter of shape {tuple(param.shape)}"
            return
        armed.seen.add(id(param))
        bucket = self._buckets[index]
        bucket.waiting -= 1
        # In order, never the last bucket (it carries the flag, known only at reduce time).
        while (
            armed.launched < len(self._buckets) - 1
            and self._buckets[armed.launched].waiting <= 0
            and armed.error is None
        ):
            if not armed.may_launch():
                return
            try:
                armed.works.append(self._launch(armed.launched, armed.pg, None))
            except Exception as exc:  # a broken group: reduce() sees it and regroups
                armed.error = exc
                return
            armed.launched += 1

    def _launch(self, index: int, pg: Any, flag: float | None) -> Any:
        bucket = self._buckets[index]
        bucket.buffer = flatten_grads(bucket.params, self.device, flag, bucket.buffer)
        return pg.allreduce([bucket.buffer], dist.AllreduceOptions())

    def launch(self, pg: Any, flag: float) -> list[Any]:
        """Launch what the armed backward did not (in order, the last with ``flag``);
        returns every bucket's work of this step, in order.

        Raises:
            Exception: the group refused a collective (the caller regroups).
        """
        armed, self._armed = self._armed, None
        works: list[Any] = []
        start = 0
        if armed is not None and armed.twice is not None:
            raise OverlapMisuse(
                f"the gradient of {armed.twice} was accumulated twice in the step's last "
                "micro-batch while its bucket was already being all-reduced: call backward() "
                "once per micro-batch (sum the losses first), or turn the overlap off with "
                "torchrelay.init(overlap=False) or TORCHRELAY_OVERLAP=0"
            )
        if armed is not None and armed.pg is pg:
            works, start = list(armed.works), armed.launched
            if armed.error is not None:
                self.forget()
                raise armed.error
        for index in range(start, len(self._buckets)):
            last = index == len(self._buckets) - 1
            works.append(self._launch(index, pg, flag if last else None))
        return works

    def finish(self, world_size: int) -> bool:
        """Put the all-reduced means into the gradients; returns the boundary flag."""
        flag = False
        for bucket in self._buckets:
            assert bucket.buffer is not None
            if bucket.last:
                flag = bool(bucket.buffer[-1].item() > 0)
            unflatten_grads(bucket.buffer, bucket.params, world_size)
        return flag

    def forget(self) -> list[Any]:
        """After a failed or abandoned all-reduce: new buffers next time (the old ones may
        still be written by the abandoned collectives); returns them and any collective
        the backward launched, to keep."""
        armed, self._armed = self._armed, None
        old: list[Any] = list(armed.works) if armed is not None else []
        old += [b.buffer for b in self._buckets if b.buffer is not None]
        for b in self._buckets:
            b.buffer = None
        return old
