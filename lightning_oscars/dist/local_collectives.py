"""``torch.distributed`` called by user code inside a local step (a self-supervised loss that all-reduces its center
on every step), and gathering lists whose lengths differ between ranks.

Inside a local step every rank runs a different number of steps, so a collective there could never be matched: the
ranks would pair one rank's step-5 all-reduce with another's averaging and crash on a size mismatch, or hang.
:class:`LocalWorld` replaces the public collectives of ``torch.distributed`` for the length of one ``training_step``:

* ``all_reduce`` acts as if every rank held this rank's tensor (local SGD's reading: each rank trains as a stand-in
  for the world, and the round makes the state equal): a sum becomes ``world_size`` times the value, a mean, maximum
  or minimum leaves it as it is. A DINO center computed as ``all_reduce(sum) / world_size`` is then this rank's mean;
* every other collective (gathers, broadcasts, barriers, point to point) has no such reading and raises an error
  naming the call, before anything is sent.

:func:`gather_ragged` gathers a list of tensors whose length differs between ranks (each rank listed what it trained):
element ``i`` of the result stacks the ``i``-th entries of the ranks whose list is that long.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d

__all__ = ["LocalWorld", "gather_ragged", "put_back", "refused_collectives"]

_REFUSED = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)


def refused_collectives() -> tuple[str, ...]:
    """The ``torch.distributed`` functions :class:`LocalWorld` refuses inside a local step."""
    return tuple(name for name in _REFUSED if hasattr(dist, name))


class _Done:
    """What an ``async_op=True`` call returns: a request that has already completed."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def local_all_reduce(tensor: Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    """``all_reduce`` over a world whose every rank holds ``tensor`` (in place)."""
    n = dist.get_world_size(group)
    with torch.no_grad():
        if op == dist.ReduceOp.SUM:
            tensor.mul_(n)
        elif op == dist.ReduceOp.PRODUCT:
            tensor.pow_(n)
        elif op == dist.ReduceOp.BXOR:
            if n % 2 == 0:
                tensor.zero_()
        elif op not in (dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.BAND, dist.ReduceOp.BOR):
            raise RuntimeError(f"all_reduce with {op} inside training_step has no local reading under local steps")
    return _Done() if async_op else None


def _in_thread(thread: int, replacement: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """``replacement`` on the step's thread, ``original`` on every other (a parameter server's thread serves its
    shard point to point while the step runs)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return (replacement if threading.get_ident() == thread else original)(*args, **kwargs)

    call.__wrapped__ = replacement  # type: ignore[attr-defined]
    return call


class LocalWorld:
    """Replaces ``torch.distributed``'s public collectives while a local step runs (see the module docstring); puts
    the originals back on exit, whatever happened. Only the thread that entered it is affected. ``strategy``: the
    strategy's name, for the errors."""

    def __init__(self, strategy: str = "oscars") -> None:
        self.strategy = strategy
        self._saved: list[tuple[Any, str, Any]] = []

    def _refuse(self, name: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"torch.distributed.{name} was called inside training_step, which under strategy={self.strategy!r}"
                " runs a different number of times on every rank, so the call could never be matched. Only"
                " all_reduce has a local reading there (as if every rank held this rank's values). Move the call to"
                " an epoch or validation hook, or use strategy='ddp'."
            )

        return refused

    def __enter__(self) -> LocalWorld:
        replacements = {"all_reduce": local_all_reduce, **{name: self._refuse(name) for name in refused_collectives()}}
        step_thread = threading.get_ident()
        for owner in (dist, distributed_c10d):
            for name, replacement in replacements.items():
                if hasattr(owner, name):
                    original = getattr(owner, name)
                    self._saved.append((owner, name, original))
                    setattr(owner, name, _in_thread(step_thread, replacement, original))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        put_back(self._saved)


def put_back(saved: list[tuple[Any, str, Any]]) -> None:
    """Restore ``(owner, name, original)`` replacements, newest first, emptying ``saved``."""
    while saved:
        owner, name, original = saved.pop()
        setattr(owner, name, original)


def gather_ragged(tensors: list[Tensor], group: Any = None) -> list[Tensor]:
    """Gather a list of tensors whose length differs between ranks (collective: every rank calls it): element ``i`` of
    the result stacks, in rank order, the ``i``-th tensor of every rank whose list has one. The tensors travel
    pickled (``all_gather_object``), so use it for the small lists it is made for."""
    device = tensors[0].device if tensors else torch.device("cpu")
    lists: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(lists, [t.detach().cpu() for t in tensors], group=group)
    longest = max(len(entries) for entries in lists)
    return [torch.stack([entries[i] for entries in lists if i < len(entries)]).to(device) for i in range(longest)]
