"""An epoch's order drawn on rank 0 and shared, or rank 0's failure to draw it raised on every rank.

A custom sampler's (or batch sampler's) draw depends on its random state, which differs between ranks: rank 0 draws
the epoch and every rank partitions that same draw, in one collective per epoch, at its start, on every rank. If
the draw raises on rank 0 (a sampler that yields what oscars cannot read, a length it does not keep), the broadcast
carries the error instead, so that every rank raises it at once rather than wait in the broadcast for rank 0's
process to exit.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ParallelStrategy

from lightning_oscars.core.epoch_order import EpochOrder

__all__ = ["EpochDrawError", "shared_epoch_order"]


class EpochDrawError(RuntimeError):
    """Rank 0 could not draw the epoch's order (raised on every other rank, with rank 0's message)."""


def shared_epoch_order(strategy: ParallelStrategy, order: EpochOrder, epoch: int) -> list[Any]:
    """Rank 0's draw of ``order`` for ``epoch``, on every rank (collective)."""
    drawn: tuple[str, Any] | None = None
    failure: BaseException | None = None
    if strategy.global_rank == 0:
        try:
            drawn = ("order", order.draw(epoch))
        except Exception as error:  # noqa: BLE001 - every rank must hear of it, then rank 0 raises its own
            failure = error
            drawn = ("error", f"{type(error).__name__}: {error}")
    received: Any = strategy.broadcast(drawn, src=0)
    kind, value = received
    if failure is not None:
        raise failure
    if kind == "error":
        raise EpochDrawError(f"Rank 0 failed to draw the order of training epoch {epoch}: {value}")
    return list(value)
