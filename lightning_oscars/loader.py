"""The training loader oscars substitutes for the user's: speed-proportional, round by round.

:class:`LoadBalancedLoader` yields one item per Lightning batch on every rank, so Lightning's counters agree
across ranks. In a slot where its rank trains it yields the next batch of the rank's share; in a slot where
the rank idles it yields the previous batch object again (nothing is fetched or collated) and records that
the slot is a no-op, which the strategy reads in ``batch_to_device``. Real batches come from an ordinary
``DataLoader`` over the user's dataset (same collate function, workers, pinning) whose batch sampler is this
rank's upcoming index lists; it is rebuilt only when the schedule changes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_oscars.partition import EpochPlan

__all__ = ["LoadBalancedLoader", "SlotInfo"]

# DataLoader arguments carried over from the user's loader to the inner ones.
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


class SlotInfo:
    """What one yielded batch is: a real step or a no-op, and how many samples it holds."""

    __slots__ = ("real", "samples")

    def __init__(self, real: bool, samples: int) -> None:
        self.real = real
        self.samples = samples


class _EpochSampler:
    """Holds the epoch number for Lightning's ``set_epoch`` call."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class LoadBalancedLoader:
    """Wraps the user's training ``DataLoader``; see the module docstring.

    Args:
        dataloader: the user's loader; its dataset, batch size, ``drop_last`` and worker settings are used.
        rank, world_size: this process's place.
        shuffle: shuffle the epoch's order (seeded by ``seed + epoch``, identical on every rank).
        batches_per_slot: ``accumulate_grad_batches``.
    """

    def __init__(
        self,
        dataloader: DataLoader,
        rank: int,
        world_size: int,
        shuffle: bool,
        seed: int,
        batches_per_slot: int = 1,
    ) -> None:
        dataset = dataloader.dataset
        if isinstance(dataset, IterableDataset):
            raise ValueError(
                "strategy='oscars' partitions the training data by index and cannot split an IterableDataset;"
                " use a map-style Dataset (with __len__ and __getitem__), or strategy='ddp'."
            )
        if dataloader.batch_size is None:
            raise ValueError(
                "strategy='oscars' needs the training DataLoader's batch_size; a custom batch_sampler is not"
                " supported. Pass batch_size=... (and drop_last) to the DataLoader instead."
            )
        try:
            size = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError("strategy='oscars' needs a training dataset with a length (__len__)") from None
        self.dataset: Dataset = dataset
        self.batch_size = int(dataloader.batch_size)
        self.drop_last = bool(dataloader.drop_last)
        self.num_samples = size
        self.num_batches = size // self.batch_size if self.drop_last else math.ceil(size / self.batch_size)
        self.batches_per_slot = batches_per_slot
        self.total_units = math.ceil(self.num_batches / batches_per_slot)
        # Slots per epoch that no schedule exceeds; the strategy tightens it (see max_epoch_slots).
        self.max_slots = self.total_units
        if self.total_units < world_size:
            raise ValueError(
                f"The training set has {size} samples: {self.num_batches} batches of {self.batch_size}, fewer than"
                f" one optimizer step for each of the {world_size} ranks per epoch. Use a smaller batch size or"
                " fewer ranks."
            )
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.sampler = _EpochSampler()
        self._loader_kwargs = {k: getattr(dataloader, k) for k in _CARRIED if hasattr(dataloader, k)}
        if self._loader_kwargs.get("num_workers", 0) == 0:
            for key in ("prefetch_factor", "persistent_workers", "timeout"):
                self._loader_kwargs.pop(key, None)
        self.plan: EpochPlan | None = None
        self.start_position = 0  # set by the strategy when Lightning resumes mid-epoch
        self.slot_infos: deque[SlotInfo] = deque()
        self.samples_seen = 0

    def __len__(self) -> int:
        # An upper bound: the strategy shortens each epoch to its plan through trainer.num_training_batches.
        return self.max_slots * self.batches_per_slot

    def set_plan(self, plan: EpochPlan) -> None:
        self.plan = plan

    def epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[Any]:
        return _EpochIterator(self)


class _EpochIterator:
    def __init__(self, owner: LoadBalancedLoader) -> None:
        self.owner = owner
        self._order: list[int] | None = None
        # Index of the next Lightning batch in the epoch. Read at the first batch, not here: when resuming
        # mid-epoch Lightning creates the iterator before the strategy learns the restored position.
        self.position = -1
        self.last_batch: Any = None
        self._inner: Iterator[Any] | None = None
        self._inner_version = -1
        owner.slot_infos.clear()

    def _indices(self, batch: int) -> list[int]:
        if self._order is None:  # drawn lazily: Lightning calls set_epoch after creating the iterator
            self._order = self.owner.epoch_order(self.owner.sampler.epoch)
        b = self.owner.batch_size
        return self._order[batch * b : (batch + 1) * b]

    def _batch_at(self, position: int) -> int | None:
        """The epoch batch trained at Lightning batch ``position`` by this rank, or ``None`` for a no-op."""
        owner = self.owner
        plan = owner.plan
        slot, within = divmod(position, owner.batches_per_slot)
        if plan is None:
            # Only the first batch of an epoch can be fetched before the strategy plans it, and a rank's
            # first unit never depends on the plan (see partition.py).
            unit: int | None = owner.rank if slot == 0 else None
        elif slot >= plan.total_slots:
            unit = None
        else:
            unit = plan.unit_at(owner.rank, slot)
        if unit is None:
            return None
        batch = unit * owner.batches_per_slot + within
        return batch if batch < owner.num_batches else None

    def _rebuild_inner(self) -> None:
        owner = self.owner
        plan = owner.plan
        assert plan is not None
        upcoming = []
        for position in range(self.position, plan.total_slots * owner.batches_per_slot):
            batch = self._batch_at(position)
            if batch is not None:
                upcoming.append(self._indices(batch))
        loader = DataLoader(owner.dataset, batch_sampler=upcoming, **owner._loader_kwargs)
        self._inner = iter(loader)
        self._inner_version = plan.version

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        owner = self.owner
        if self.position < 0:
            self.position, owner.start_position = owner.start_position, 0
        if self.position >= len(owner):
            raise StopIteration
        batch = self._batch_at(self.position)
        if batch is None:
            info = SlotInfo(False, 0)
            if self.last_batch is None:
                # Only when resuming into a no-op slot: Lightning skips a None batch entirely (no step, no
                # counters), so show the hooks a real batch of this rank's data, fetched once and not trained on.
                indices = self._indices(owner.rank)
                self.last_batch = next(iter(DataLoader(owner.dataset, batch_sampler=[indices], **owner._loader_kwargs)))
            item = self.last_batch
        else:
            indices = self._indices(batch)
            if owner.plan is None:
                item = DataLoader(owner.dataset, batch_sampler=[indices], **owner._loader_kwargs).__iter__().__next__()
            else:
                if self._inner is None or self._inner_version != owner.plan.version:
                    self._rebuild_inner()
                assert self._inner is not None
                item = next(self._inner)
            info = SlotInfo(True, len(indices))
            owner.samples_seen += len(indices)
            self.last_batch = item
        self.position += 1
        owner.slot_infos.append(info)
        return item
