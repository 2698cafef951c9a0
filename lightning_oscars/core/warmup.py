"""The time-boxed warm-up: the first round lasts as long as the slowest rank's ``warmup_steps``, and faster ranks
keep training meanwhile.

Before anything is measured every rank takes ``warmup_steps`` steps and the ranks average; with a fixed number of
steps the fast ranks then idle while the slowest finishes (at 1x/5x four fifths of the round). In a time-boxed
warm-up the first round is laid out like a deadline round (``partition.py``): every rank reserves
``warmup_reservation`` units and the round lasts that many slots. A rank trains its first ``warmup_steps`` slots,
then keeps training while some other rank has not yet finished its ``warmup_steps``; each rank announces that it
has, once, through a shared counter (the rendezvous store). The rest of the round is no-op slots, and
``EpochPlan.settle`` hands the units nobody reached back to the epoch.

No collective is involved: the counter only decides which of a round's slots are real, and every rank ends the
round at the same slot whatever it reads. If the counter cannot be read, the rank stops training extra steps.

Pure: the counter is injected (:class:`StoreCounter` wraps a ``torch.distributed.Store``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

__all__ = ["StoreCounter", "WarmupGate", "warmup_reservation"]

_PREFIX = "oscars/warmup"
_fits = itertools.count()  # every rank runs the same fits in the same order: the n-th fit has the same key everywhere


def warmup_reservation(warmup_steps: int, max_local_steps: int, max_spread: int) -> int:
    """Units every rank reserves in the time-boxed warm-up round (its length in slots): room for a rank up to
    ``max_spread`` times faster than the slowest, but no more than ``max_local_steps`` (the solver's own bound on a
    round), and never fewer than the warm-up itself."""
    for name, value in (
        ("warmup_steps", warmup_steps),
        ("max_local_steps", max_local_steps),
        ("max_spread", max_spread),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return max(warmup_steps, min(max_local_steps, max_spread * warmup_steps))


class StoreCounter:
    """A counter shared by the ranks of one fit, in a ``torch.distributed.Store``: ``add(n)`` adds and returns the
    total (``add(0)`` reads it). One key per fit; the process's fits are numbered in order."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.key = f"{_PREFIX}/{next(_fits)}"

    def __call__(self, delta: int) -> int:
        return int(self.store.add(self.key, delta))


class WarmupGate:
    """Decides, for one rank, which slots of the time-boxed warm-up round are real steps.

    Args:
        world_size: ranks that must finish their warm-up.
        counter: the shared counter of ranks that finished (``counter(1)`` announces, ``counter(0)`` reads).

    The round controller calls :meth:`begin` when it lays the warm-up round out (the policy's warm-up, which
    ``max_steps`` may shorten, is known then); the loader asks :meth:`is_due` as it fetches each slot (the pacer
    protocol of ``deadline.py``); the controller calls :meth:`trained` as each slot ends, with the units this rank
    trained in the round so far.
    """

    def __init__(self, world_size: int, counter: Callable[[int], int]) -> None:
        if world_size < 1:
            raise ValueError(f"invalid warm-up gate for {world_size} ranks")
        self.world_size = world_size
        self._counter = counter
        self.warmup_steps = 0
        self.announced = False
        self.everyone_done = False

    def begin(self, warmup_steps: int) -> None:
        """The warm-up round is laid out: every rank takes ``warmup_steps`` steps before it may stop."""
        if warmup_steps < 1:
            raise ValueError(f"a warm-up takes at least one step, got {warmup_steps}")
        self.warmup_steps = warmup_steps

    def _read(self, delta: int) -> int | None:
        try:
            return self._counter(delta)
        except Exception:  # noqa: BLE001 - the store is gone (rank 0 died): the all-reduce will say so
            return None

    def trained(self, units: int) -> None:
        """A slot ended; this rank has trained ``units`` units of the round: announce once it reached the warm-up."""
        if units >= self.warmup_steps and not self.announced:
            self.announced = True
            self._read(1)

    def is_due(self, offset: int, length: int, taken: int, reserved: int, pending: int) -> bool:
        """Whether the next slot is a real step, given that ``taken`` of the ``reserved`` units were handed out: the
        warm-up's own steps always; after them, while some *other* rank has not announced (this rank counts as done,
        its last warm-up step may still be fetched and not run)."""
        if taken >= reserved:
            return False
        if taken < self.warmup_steps:
            return True
        if self.everyone_done:
            return False
        done = self._read(0)
        others_done = (done if done is not None else self.world_size) - int(self.announced)
        self.everyone_done = others_done >= self.world_size - 1
        return not self.everyone_done
