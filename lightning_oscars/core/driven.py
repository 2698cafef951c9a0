"""A training loader driven as its author wrote it: a ``DataLoader`` subclass with its own ``__iter__`` (a loader that
zips other loaders), or one over another loader.

Such a loader cannot be split by index: its batches are whatever its iteration makes. Every rank therefore iterates
it, identically, and keeps the batches the plan gives it: the unit of the partition is the loader's ``k``-th batch of
the epoch, and a rank skips (fetches without training) the batches that are other ranks'. The iteration is made
identical on every rank by drawing it from its own random state, seeded by the epoch: torch's, Python's and NumPy's
global generators are swapped for the loader's around every fetch (so that a ``RandomSampler`` inside it, seeded
from torch's global generator, shuffles alike on every rank, and training's random draws, which differ between ranks
that take different numbers of steps, are neither read nor disturbed).

The cost: every rank fetches every batch of the epoch (the data loading of ``world_size`` ranks on each); for a
loader whose batches are cheap to make next to a training step, that is little. The batches a rank skips are fetched
when it fetches its next own batch, and count in that batch's data time.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.utils.data import DataLoader

__all__ = ["DrivenLoader", "batch_rows", "is_driven"]


def is_driven(dataloader: DataLoader) -> bool:
    """Whether ``dataloader`` makes its own batches: a subclass overriding ``__iter__``, or a loader over a loader."""
    return type(dataloader).__iter__ is not DataLoader.__iter__ or isinstance(dataloader.dataset, DataLoader)


def batch_rows(batch: Any) -> int:
    """The rows of a batch: the first dimension of its first tensor of at least one dimension (0 if none)."""
    rows: list[int] = []
    apply_to_collection(batch, Tensor, lambda t: rows.append(t.shape[0]) if t.dim() > 0 else None)
    return rows[0] if rows else 0


class _OwnRandomness:
    """Random generators of the loader's own, swapped in around each fetch."""

    def __init__(self, seed: int) -> None:
        with _Swapped(None) as swapped:
            torch.manual_seed(seed)
            random.seed(seed)
            _numpy_seed(seed)
            self.state = swapped.current()

    def __enter__(self) -> None:
        self._outside = _Swapped(self.state)
        self._outside.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.state = self._outside.current()
        self._outside.__exit__(*exc)


class _Swapped:
    """Sets the global generators to ``state`` (``None``: leaves them) and puts the previous ones back on exit."""

    def __init__(self, state: tuple[Any, ...] | None) -> None:
        self.state = state

    @staticmethod
    def current() -> tuple[Any, ...]:
        return torch.get_rng_state(), random.getstate(), _numpy_state()

    def __enter__(self) -> _Swapped:
        self.saved = self.current()
        if self.state is not None:
            _restore(self.state)
        return self

    def __exit__(self, *exc: object) -> None:
        _restore(self.saved)


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is a dependency
        return None
    return numpy.random.get_state()


def _numpy_seed(seed: int) -> None:
    try:
        import numpy
    except ImportError:  # pragma: no cover
        return
    numpy.random.seed(seed % 2**32)


def _restore(state: tuple[Any, ...]) -> None:
    torch_state, python_state, numpy_state = state
    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    if numpy_state is not None:
        import numpy

        numpy.random.set_state(numpy_state)


class DrivenLoader:
    """The user's self-iterating loader, fetched by position in the epoch's stream (see the module docstring)."""

    def __init__(self, dataloader: DataLoader, seed: int) -> None:
        try:
            self.num_batches = len(dataloader)
        except TypeError:
            raise ValueError(
                f"The training loader {type(dataloader).__name__} makes its own batches but has no length; oscars"
                " needs len() to plan the epoch. Give it a __len__, or use strategy='ddp'."
            ) from None
        self.dataloader = dataloader
        self.seed = seed
        self.epoch = 0
        self._iterator: Iterator[Any] | None = None
        self._position = 0  # of the next batch the iterator yields
        self._randomness: _OwnRandomness | None = None

    def start_epoch(self, epoch: int) -> None:
        """A new epoch: the user's samplers are told it (``set_epoch``), and the stream starts again."""
        self.epoch = epoch
        for source in (self.dataloader.sampler, self.dataloader.batch_sampler):
            set_epoch = getattr(source, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
        self.close()

    def close(self) -> None:
        self._iterator, self._randomness = None, None

    def _restart(self) -> None:
        self._randomness = _OwnRandomness(self.seed + self.epoch)
        with self._randomness:
            self._iterator = iter(self.dataloader)
        self._position = 0

    def _next(self) -> Any:
        assert self._iterator is not None and self._randomness is not None
        with self._randomness:
            try:
                batch = next(self._iterator)
            except StopIteration:
                raise ValueError(
                    f"The training loader {type(self.dataloader).__name__} yielded {self._position} batches this"
                    f" epoch but its length is {self.num_batches}; oscars plans the epoch from len(), which must"
                    " match what it yields."
                ) from None
        self._position += 1
        return batch

    def batch_at(self, position: int) -> Any:
        """The epoch's ``position``-th batch (the stream restarts, identically, for a position already passed)."""
        if self._iterator is None or position < self._position:
            self._restart()
        while self._position < position:
            self._next()  # another rank's batch
        return self._next()

    def fetch(self, positions: Sequence[int]) -> Iterator[Any]:
        """The batches at ``positions``, in that order."""
        return (self.batch_at(position) for position in positions)
