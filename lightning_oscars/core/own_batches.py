"""A training iterable that is not a ``DataLoader`` (a library's own batch iterator): each rank draws from its copy.

Some libraries hand Lightning a plain Python iterable of ready batches: no sampler, no indices, often an endless
stream of random windows cut to a fixed number of batches per pass (its ``__len__``). Under ddp every rank iterates
its own copy once per epoch, so an epoch trains ``world_size * len(iterable)`` batches in all. oscars keeps that
budget and deals it by speed: the epoch's units are those batches, the plan gives each rank its count, and a rank
takes its batches in order from its own copy, starting a new pass (``iter`` again) when the copy ends, so a fast
rank trains more than one pass and a slow one less. Nothing is indexed, so the trade-off is the source's own: a
fixed, finite iterable (a list of batches) has a fast rank repeat batches of its copy in a second pass, as every
ddp rank trains every batch of its copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["OwnBatches", "is_own_batches"]


def is_own_batches(loader: object) -> bool:
    """Whether ``loader`` is a training iterable of its own batches (anything iterable but a ``DataLoader``)."""
    return not isinstance(loader, DataLoader) and isinstance(loader, Iterable)


class OwnBatches:
    """One rank's draw from its own copy of the iterable (see the module docstring); the epoch's units are
    ``world_size`` passes' worth of batches."""

    def __init__(self, iterable: Any, world_size: int) -> None:
        try:
            per_pass = len(iterable)
        except TypeError:
            raise ValueError(
                f"strategy='oscars' trains a training iterable that is not a DataLoader ({type(iterable).__name__})"
                " when it has a length (its batches per pass, what each ddp rank trains per epoch): this one has"
                " none. Give it a __len__, or wrap it in a DataLoader."
            ) from None
        if per_pass < 1:
            raise ValueError(f"the training iterable {type(iterable).__name__} has no batch (its length is 0)")
        self.iterable = iterable
        self.per_pass = per_pass
        self.num_batches = per_pass * world_size  # ddp's epoch: every rank's pass
        self.passes = 0  # passes this rank started (read by tests and the docs' example)
        self._iterator: Iterator[Any] | None = None

    def start_epoch(self, epoch: int) -> None:
        """A new epoch starts a new pass (the iterable told the epoch when it listens for it)."""
        set_epoch = getattr(self.iterable, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        self.close()

    def close(self) -> None:
        self._iterator = None

    def _next(self) -> Any:
        if self._iterator is None:
            self._iterator, self.passes = iter(self.iterable), self.passes + 1
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = None
        self._iterator, self.passes = iter(self.iterable), self.passes + 1
        try:
            return next(self._iterator)
        except StopIteration:
            raise ValueError(f"the training iterable {type(self.iterable).__name__} yielded no batch") from None

    def fetch(self, units: Sequence[int]) -> Iterator[Any]:
        """The next ``len(units)`` batches of this rank's copy, drawn as they are asked for (which units they stand
        for does not matter: every batch of the copy is this rank's)."""
        for _ in units:
            yield self._next()

    def batch_at(self, unit: int) -> Any:
        """One batch outside the stream (the shape of a no-op slot's empty batch): the first of a fresh pass."""
        return next(iter(self.iterable))
