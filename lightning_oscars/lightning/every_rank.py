"""A step of preparation that every rank takes before its next collective, whose failure on one rank is raised on
every rank.

Building the training loader and starting an epoch are local work (a data set's length, a user's ``set_epoch``, the
plan), and a failure there is often one rank's alone: a file missing on one node, a sampler that checks its rank.
Left alone, that rank raises while its peers go on into the next collective (Lightning's length check, the round's
averaging) and wait there until the failing process exits, to then report a broken connection instead of the cause.
Here every rank takes the step, then all reach one small all-gather of "failed, and why" (and of what the ranks must
agree on, such as the training set's size): a rank that failed raises its own error, and every other rank raises
:class:`PeerFailure` with the failing rank's message, at once.

A peer that is already gone (its process died between rounds) makes the all-gather itself fail; that is left to the
round's exchange, which detects lost ranks and recovers from them, so the step's own result is returned as if alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy

__all__ = ["PeerFailure", "on_every_rank"]

T = TypeVar("T")


class PeerFailure(RuntimeError):
    """Another rank failed a step every rank takes (raised on the ranks that did not fail, with its message)."""


def on_every_rank(
    strategy: ParallelStrategy, what: str, step: Callable[[], T], agree: Callable[[T], Any] | None = None
) -> T:
    """``step()`` on this rank, then one all-gather with every other rank (collective: every rank calls it).

    ``what`` completes "Rank r failed while ...". ``agree``: a value of the step's result that must be the same on every
    rank (a mismatch is an error on every rank naming each rank's value)."""
    failure: Exception | None = None
    result: Any = None
    try:
        result = step()
    except Exception as error:  # noqa: BLE001 - every rank must hear of it; this rank raises its own below
        failure = error
    if strategy.world_size <= 1 or not dist.is_available() or not dist.is_initialized():
        if failure is not None:
            raise failure
        return result  # type: ignore[no-any-return]
    mine = (f"{type(failure).__name__}: {failure}", None) if failure is not None else (None, _agreed(agree, result))
    everyone: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(everyone, mine)
    except Exception:  # noqa: BLE001 - a peer is gone: the round's exchange finds it and recovers (see above)
        everyone = [mine]
    if failure is not None:
        raise failure
    failed = [(rank, message) for rank, (message, _) in enumerate(everyone) if message is not None]
    if failed:
        told = "; ".join(f"rank {rank}: {message}" for rank, message in failed)
        raise PeerFailure(f"Rank {failed[0][0]} failed while {what}, so every rank stops here ({told})")
    values = [value for _, value in everyone]
    if any(value != values[0] for value in values):
        each = ", ".join(f"{value} on rank {rank}" for rank, value in enumerate(values))
        raise ValueError(f"The ranks disagree while {what}: {each}. Every rank must see the same training data.")
    return result  # type: ignore[no-any-return]


def _agreed(agree: Callable[[Any], Any] | None, result: Any) -> Any:
    return None if agree is None else agree(result)
