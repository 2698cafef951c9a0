"""The order in which an epoch visits the training samples: what the user's sampler asks for.

:class:`EpochOrder` reads the user's (possibly Lightning-wrapped) sampler once, at setup, and draws each epoch's
order of sample indices, which the loader then partitions between ranks by speed.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from lightning_oscars.core.driven import DrivenLoader
from lightning_oscars.core.loader_shape import global_view, loader_shape, unit_source

__all__ = ["EpochOrder", "EpochSampler", "training_set_size"]


class EpochOrder:
    """The order in which an epoch visits the training samples, as the user's sampler defines it.

    * ``"sequential"``: ``0 .. n-1`` (a ``SequentialSampler``, or an unshuffled ``DistributedSampler``);
    * ``"permutation"``: a permutation seeded by ``seed + epoch``, identical on every rank (a ``RandomSampler``,
      or the shuffling ``DistributedSampler`` Lightning injects);
    * ``"sampler"``: whatever the user's own sampler yields this epoch (weighted, curriculum, with replacement,
      ...), possibly not ``n`` indices. Only one rank may draw it (a sampler's random state differs between
      ranks): :attr:`shared` tells the strategy to draw on rank 0 and broadcast.
    * ``"units"``: the user's batches as its batch sampler (or a ``batch_size=None`` loader's sampler) yields them
      this epoch, each kept whole (``loader_shape.py``); drawn on rank 0 and broadcast likewise.
    """

    def __init__(self, kind: str, num_samples: int, seed: int = 0, sampler: Sampler | None = None) -> None:
        if kind not in ("sequential", "permutation", "sampler", "units"):
            raise ValueError(f"unknown epoch order {kind!r}")
        if kind in ("sampler", "units") and sampler is None:
            raise ValueError("a sampler order needs the sampler")
        self.kind = kind
        self.num_samples = num_samples
        self.seed = seed
        self.sampler = sampler

    @property
    def shared(self) -> bool:
        """Whether ranks must share one rank's draw (they cannot reproduce it independently)."""
        return self.kind in ("sampler", "units")

    def draw(self, epoch: int) -> list[int]:
        if self.kind == "sequential":
            return list(range(self.num_samples))
        if self.kind == "permutation":
            generator = torch.Generator().manual_seed(self.seed + epoch)
            return torch.randperm(self.num_samples, generator=generator).tolist()
        assert self.sampler is not None
        for source in (self.sampler, getattr(self.sampler, "sampler", None)):  # a batch sampler's own sampler too
            set_epoch = getattr(source, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
        order = list(self.sampler) if self.kind == "units" else [int(i) for i in self.sampler]  # type: ignore[call-overload]
        if len(order) != self.num_samples:
            what = "batches" if self.kind == "units" else "indices"
            raise ValueError(
                f"The training sampler yielded {len(order)} {what} this epoch but its length is {self.num_samples};"
                " oscars sizes every epoch from len(sampler), which must match what it yields."
            )
        return order

    @classmethod
    def of(cls, sampler: object, dataset_size: int, seed: int | None) -> EpochOrder:
        """The order the user's ``sampler`` asks for (unwrapped from Lightning's wrapper by the caller: see
        ``lightning._internals.unwrap_sampler``; a ``DistributedSampler`` subclass as its global view,
        ``loader_shape.global_view``, drawn as any custom sampler). ``seed`` (the strategy's, or ``None`` to follow
        the sampler's or ``seed_everything``'s) seeds a shuffled order."""
        if type(sampler) is DistributedSampler:  # injected by Lightning (or plain): its shuffle flag and seed
            kind = "permutation" if sampler.shuffle else "sequential"
            return cls(kind, dataset_size, sampler.seed if seed is None else seed)
        if seed is None:
            seed = _global_seed()
        if isinstance(sampler, SequentialSampler):
            return cls("sequential", dataset_size, seed)
        if type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == dataset_size:
            return cls("permutation", dataset_size, seed)
        if not isinstance(sampler, Sampler) and not hasattr(sampler, "__iter__"):
            raise ValueError(f"strategy='oscars' cannot read the training sampler {sampler!r}")
        return cls("sampler", _length("sampler", sampler), seed, sampler)  # type: ignore[arg-type]

    @classmethod
    def of_loader(cls, dataloader: DataLoader, seed: int | None, unwrap: Callable[[object], object]) -> EpochOrder:
        """The order of a training ``dataloader`` as Lightning set it up: of its samples, or of its batches when it
        batches itself (``loader_shape.py``), its sampler read as the global order (``unwrap``: what takes Lightning's
        wrapper off)."""
        shape = loader_shape(dataloader)
        if shape == "samples":
            return cls.of(global_view(dataloader.sampler, unwrap), training_set_size(dataloader), seed)
        if shape == "driven":  # its k-th batch, k in stream order (driven.py)
            return cls("sequential", DrivenLoader(dataloader, 0).num_batches, _global_seed() if seed is None else seed)
        return cls.of_units(global_view(unit_source(dataloader), unwrap), seed)

    @classmethod
    def of_units(cls, source: object, seed: int | None) -> EpochOrder:
        """The order of the user's batches that ``source`` (a batch sampler, or a ``batch_size=None`` loader's
        sampler, as its global view) yields."""
        length = _length("batch sampler", source)
        return cls("units", length, _global_seed() if seed is None else seed, source)  # type: ignore[arg-type]


def _length(what: str, source: object) -> int:
    try:
        return len(source)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"The training {what} {type(source).__name__} has no length; oscars needs its len() to plan the epoch."
            " Give it a __len__, or use strategy='ddp'."
        ) from None


def training_set_size(dataloader: DataLoader) -> int:
    """The number of samples of a training loader's map-style dataset; a clear error for what oscars cannot split."""
    dataset = dataloader.dataset
    if isinstance(dataset, IterableDataset):
        raise ValueError(
            "strategy='oscars' partitions the training data by index and cannot split an IterableDataset;"
            " use a map-style Dataset (with __len__ and __getitem__), or strategy='ddp'."
        )
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError("strategy='oscars' needs a training dataset with a length (__len__)") from None


def _global_seed() -> int:
    """The seed of ``seed_everything`` (Lightning exports it as ``PL_GLOBAL_SEED``), else 0."""
    value = os.environ.get("PL_GLOBAL_SEED")
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0


class EpochSampler:
    """Holds the epoch number for Lightning's ``set_epoch`` call (the load-balanced loader's ``sampler``)."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
