"""What the unit of a user's training loader is, and how oscars fetches its units on one rank.

The load-balanced loader (``loader.py``) splits an epoch between ranks unit by unit. A loader is one of:

* ``"samples"``: a ``batch_size`` and a sampler of sample indices (the default ``BatchSampler`` over them). The unit
  is a sample; ranks' batches are cut from the epoch's order, ``batch_size`` each.
* ``"batch_sampler"``: a custom ``batch_sampler`` (length buckets, as speech and NLP code uses). The unit is one of
  the user's batches, an index list, fetched sample by sample and collated as the user's loader would.
* ``"items"``: ``batch_size=None``, so that each item its sampler yields is fetched whole (``dataset[item]``, the
  sampler often a ``BatchSampler`` yielding index lists, as single-cell and tabular libraries do). The unit is an item.
* ``"driven"``: a ``DataLoader`` subclass with its own ``__iter__``, or a loader over a loader: driven as written,
  every rank iterating it alike (``driven.py``). The unit is the loader's ``k``-th batch.
* ``"own"``: an iterable of ready batches that is not a ``DataLoader`` (a library's batch iterator): every rank
  draws from its own copy, ddp's budget of ``world_size`` passes dealt by speed (``own_batches.py``). The unit is
  one of those batches.

Under the last two every batch the user's sampler yields is trained once per epoch, in its order; a batch is not
split, so per-rank batch sizes and replica groups do not apply. A sampler that is a ``DistributedSampler`` subclass
(a library's own ddp path) is read as the global order it shards: a copy of it over one replica
(:func:`global_view`), which oscars then splits by speed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from lightning_oscars.core.driven import DrivenLoader, is_driven
from lightning_oscars.core.own_batches import OwnBatches, is_own_batches

__all__ = [
    "LoaderShape",
    "UnitFeed",
    "batch_source",
    "check_unit_loader",
    "describe_shape",
    "feed_batches",
    "global_view",
    "inner_loader",
    "inner_loader_kwargs",
    "loader_shape",
    "unit_samples",
    "unit_source",
]

LoaderShape = Literal["samples", "batch_sampler", "items", "driven", "own"]

# DataLoader arguments carried over from the user's loader to the inner one.
_CARRIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def inner_loader_kwargs(dataloader: Any) -> dict[str, Any]:
    """What an inner ``DataLoader`` over the user's dataset takes from the user's loader (collate function, workers,
    pinning, ...); the worker-only arguments only when it has workers. None for an iterable of its own batches."""
    if is_own_batches(dataloader):
        return {}
    kwargs = {k: getattr(dataloader, k) for k in _CARRIED if hasattr(dataloader, k)}
    if kwargs.get("num_workers", 0) == 0:
        for key in ("prefetch_factor", "persistent_workers", "timeout"):
            kwargs.pop(key, None)
    return kwargs


def loader_shape(dataloader: Any) -> LoaderShape:
    """Which of the module docstring's shapes ``dataloader`` is."""
    if is_own_batches(dataloader):
        return "own"
    if is_driven(dataloader):
        return "driven"
    if dataloader.batch_size is not None:
        return "samples"
    return "batch_sampler" if dataloader.batch_sampler is not None else "items"


def batch_source(
    dataloader: Any, shape: LoaderShape, seed: int, world_size: int
) -> DrivenLoader | OwnBatches | None:
    """What makes the batches of a loader that makes its own (``"driven"``, ``"own"``); ``None`` for the others,
    whose batches an inner loader fetches by index."""
    if shape == "driven":
        return DrivenLoader(dataloader, seed)
    return OwnBatches(dataloader, world_size) if shape == "own" else None


def unit_source(dataloader: DataLoader) -> object:
    """What yields the units of ``dataloader``: its sampler, or its custom batch sampler."""
    if loader_shape(dataloader) == "batch_sampler":
        return dataloader.batch_sampler
    return dataloader.sampler


def global_view(source: object, unwrap: Callable[[object], object] = lambda s: s) -> object:
    """The global order a sampler or batch sampler shards, as a copy over one replica that yields every rank's share
    (``source`` itself when it shards nothing). A ``DistributedSampler`` (a library's own subclass, or the one
    Lightning injects) keeps its seed, shuffle and own ``__iter__``; a batch sampler over one is copied around the
    global view of its sampler. ``unwrap``: what takes a Lightning wrapper off (``_internals.unwrap_sampler``)."""
    source = unwrap(source)
    if isinstance(source, DistributedSampler):
        if source.num_replicas == 1:
            return source
        whole = copy.copy(source)
        whole.num_replicas, whole.rank = 1, 0
        whole.num_samples = whole.total_size = len(source.dataset)  # type: ignore[arg-type]
        return whole
    inner = getattr(source, "sampler", None)
    if inner is not None and not isinstance(source, DataLoader):
        seen = global_view(inner, unwrap)
        if seen is not inner:
            outer: Any = copy.copy(source)
            outer.sampler = seen
            return outer
    return source


def unit_samples(unit: Any) -> int:
    """How many samples a unit (an index, or an index list) holds."""
    try:
        return len(unit)
    except TypeError:
        return 1


class UnitFeed:
    """The inner loader's source: this rank's upcoming batches, replaced at every re-plan (index lists under
    ``"samples"`` and ``"batch_sampler"``; the user's items under ``"items"``)."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def inner_loader(
    dataset: Any, feed: UnitFeed | Sequence[Any], shape: LoaderShape, kwargs: dict[str, Any]
) -> DataLoader:
    """A ``DataLoader`` over the user's dataset that fetches ``feed``'s batches as the user's loader would."""
    if shape == "items":  # each item fetched whole, converted (not collated) as with batch_size=None
        return DataLoader(dataset, batch_size=None, sampler=feed, **kwargs)  # type: ignore[arg-type]
    return DataLoader(dataset, batch_sampler=feed, **kwargs)  # type: ignore[arg-type]


def feed_batches(blocks_units: Sequence[Sequence[Any]], shape: LoaderShape) -> list[Any]:
    """The inner loader's batches for this rank's upcoming batches, each given as the units it holds: an index list
    of samples (``"samples"``), the user's batch (``"batch_sampler"``: its indices), or the user's item."""
    if shape == "samples":
        return [list(units) for units in blocks_units]
    if shape == "batch_sampler":
        return [[int(i) for unit in units for i in unit] for units in blocks_units]
    return [units[0] for units in blocks_units]


def describe_shape(shape: LoaderShape) -> str:
    """What makes a loader of this shape batch itself, for messages."""
    return {
        "samples": "a batch_size",
        "batch_sampler": "a custom batch_sampler",
        "items": "batch_size=None (its sampler yields batches)",
        "driven": "its own iteration (a DataLoader subclass overriding __iter__)",
        "own": "batches of its own (an iterable that is not a DataLoader)",
    }[shape]


def check_unit_loader(shape: LoaderShape, batch_sizes: Sequence[int] | None, replica_size: int) -> None:
    """A clear error where an option needs to resize or split the user's batches, which this shape keeps whole."""
    if shape == "samples":
        return
    what = describe_shape(shape)
    if batch_sizes is not None:
        raise ValueError(
            f"batch_sizes cannot apply to the training DataLoader: it has {what}, whose batches oscars trains whole"
            " and cannot resize per rank. Remove batch_sizes, or give the DataLoader a batch_size."
        )
    if replica_size != 1:
        raise ValueError(
            f"replica_size={replica_size} cannot apply to the training DataLoader: it has {what}, whose batches"
            " oscars trains whole and cannot split between a replica's ranks. Use replica_size=1, or give the"
            " DataLoader a batch_size."
        )
