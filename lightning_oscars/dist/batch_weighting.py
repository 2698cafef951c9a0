"""The one collective of a batch-balanced step: the mean gradient over ddp's global batch, and what must stay equal.

Under batch balancing rank ``r`` trains ``n_r`` of the step's ``N`` samples and its loss (a mean over its share) is
scaled by ``n_r * W / N`` before backward (:func:`share_weight`), so that the plain mean over the ``W`` ranks of the
scaled gradients is ``sum_r (n_r / N) * grad_r``: the gradient of the mean loss over the whole global batch, ddp's
step. :class:`StepSync` makes that mean in one all-reduce per optimizer step, with three things riding in the same
buffer:

* whether each parameter has a gradient on any rank (a parameter no rank used keeps ``grad is None``, as under ddp
  with ``find_unused_parameters``; one some rank used gets the mean, zeros standing in for the others);
* the floating-point buffers of rank 0 (BatchNorm's running statistics), added to zeros from the others: every rank
  holds rank 0's after every step, as ddp's ``broadcast_buffers`` gives it at the next forward, so the ranks are
  identical at validation, in checkpoints and at the end;
* a control tail the caller fills (each rank's measured step, in its own slots): every rank receives every rank's.

The buffer is in the widest floating dtype of the gradients (at least float32); gradients of lower precision are
reduced in it and cast back.

A rank's measured step must be its own work, not its wait for the slowest rank: :class:`WaitTimer` times every
``torch.distributed`` collective the training thread makes while a fit runs (Lightning's per-batch SIGTERM
broadcast, ``self.log(..., sync_dist=True)``, a loss that all-reduces inside the step), outermost calls only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import distributed_c10d

from lightning_oscars.dist.local_collectives import put_back, refused_collectives

__all__ = ["StepSync", "WaitTimer", "share_weight"]


def share_weight(shares: Sequence[int], rank: int) -> float:
    """The factor on rank ``rank``'s loss that makes the ranks' mean gradient the global batch's mean."""
    return shares[rank] * len(shares) / sum(shares)


class StepSync:
    """The all-reduce of one optimizer step over ``module``'s trainable parameters and floating buffers (see the
    module docstring); ``group``: the process group (the default world)."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buffers = [b for b in module.buffers() if b.is_floating_point()]
        self.group = group
        dtypes = [p.dtype for p in self.params] + [torch.float32]
        self.dtype = max(dtypes, key=lambda d: torch.finfo(d).bits if d.is_floating_point else 0)

    def sync(self, control: Sequence[float] = ()) -> list[float]:
        """Average the gradients, spread rank 0's buffers, sum ``control`` over the ranks (returned)."""
        world = dist.get_world_size(self.group)
        leader = dist.get_rank(self.group) == 0
        device = self.params[0].device if self.params else (self.buffers[0].device if self.buffers else None)
        pieces: list[Tensor] = []
        for p in self.params:
            grad = p.grad
            pieces.append(torch.zeros(p.numel(), dtype=self.dtype, device=p.device) if grad is None else grad.reshape(-1).to(self.dtype))
        flags = torch.tensor([p.grad is not None for p in self.params], dtype=self.dtype, device=device)
        for b in self.buffers:
            pieces.append(b.reshape(-1).to(self.dtype) if leader else torch.zeros(b.numel(), dtype=self.dtype, device=b.device))
        tail = torch.tensor(list(control), dtype=torch.float64).to(device=device, dtype=self.dtype)
        flat = torch.cat([*pieces, flags, tail]) if pieces else torch.cat([flags, tail])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        views: list[Tensor] = []
        for p in self.params:
            views.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        for b in self.buffers:
            with torch.no_grad():
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
        used = flat[offset : offset + len(self.params)].tolist()
        offset += len(self.params)
        for p, mean, seen in zip(self.params, views, used):
            if seen == 0:
                continue
            mean = mean / world
            if p.grad is None:
                p.grad = mean.to(p.dtype).clone()
            else:
                p.grad.copy_(mean)
        return flat[offset:].double().tolist()


class WaitTimer:
    """While entered, every ``torch.distributed`` collective called on the entering thread reports its seconds to
    ``on_wait`` (a collective made inside another, as ``broadcast_object_list`` makes ``broadcast``, is counted once,
    in the outer one). Other threads are untouched; the originals are put back on exit."""

    def __init__(self, on_wait: Callable[[float], None]) -> None:
        self.on_wait = on_wait
        self._saved: list[tuple[Any, str, Any]] = []
        self._depth = 0
        self._thread = 0

    def _timed(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self._thread or self._depth:
                return original(*args, **kwargs)
            self._depth += 1
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                self.on_wait(time.perf_counter() - started)

        call.__wrapped__ = original  # type: ignore[attr-defined]
        return call

    def __enter__(self) -> WaitTimer:
        self._thread = threading.get_ident()
        for owner in (dist, distributed_c10d):
            for name in ("all_reduce", *refused_collectives()):
                original = getattr(owner, name, None)
                if original is not None:
                    self._saved.append((owner, name, original))
                    setattr(owner, name, self._timed(original))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        put_back(self._saved)
