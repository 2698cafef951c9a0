"""The training loader oscars substitutes for the user's: speed-proportional, round by round.

:class:`LoadBalancedLoader` yields one item per Lightning batch on every rank, so Lightning's counters agree
across ranks. In a slot where its rank trains it yields the next batch of the rank's share; in a slot where the
rank idles it yields an *empty batch* (this rank's last real batch with every tensor cut to zero rows: nothing
is fetched or collated, and a hook that counts samples counts none). Each yielded item is described by a
:class:`SlotInfo` (real or no-op, samples, seconds spent fetching), which the strategy reads in
``batch_to_device``.

The epoch's order of samples comes from the user's sampler (:class:`EpochOrder`): sequential, a seeded
permutation identical on every rank, or whatever a custom sampler (weighted, curriculum, ...) yields for the
epoch. Real batches come from one inner ``DataLoader`` over the user's dataset (same collate function,
workers, pinning) whose batch sampler is this rank's upcoming index lists; a re-plan hands it new lists and
restarts its iterator, so ``persistent_workers=True`` keeps the worker processes for the whole fit.

With per-rank batch sizes (``batch_sizes``) the plan's batches are *blocks* of the sizes' greatest common divisor,
and a rank whose batch size is ``w`` blocks fetches ``w`` of them for each of its batches (the plan's widths,
``partition.py``): every rank trains its own batch size, and every sample is still trained once per epoch.

In a deadline round (``deadline.py``) the rank's real slots are not planned: as Lightning fetches each slot the
loader asks its :class:`~lightning_oscars.core.deadline.DeadlinePacer` whether the next step still fits before the
round's deadline, and hands out the rank's reserved units in order while it does. A lockstep scheme (BSP) may close
the running deadline round (:meth:`LoadBalancedLoader.close_round`): its remaining slots become no-ops, the real
ones already fetched included, and the units they held count as not reached.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader, Dataset

from lightning_oscars.core.combined import empty_batch, plan_batches
from lightning_oscars.core.deadline import DeadlinePacer
from lightning_oscars.core.driven import batch_rows
from lightning_oscars.core.epoch_order import EpochOrder, EpochSampler, training_set_size
from lightning_oscars.core.loader_shape import (
    UnitFeed,
    batch_source,
    check_unit_loader,
    feed_batches,
    inner_loader,
    inner_loader_kwargs,
    loader_shape,
    unit_samples,
)
from lightning_oscars.core.partition import EpochPlan
from lightning_oscars.core.quotas import block_widths
from lightning_oscars.core.replicas import ReplicaLayout, replica_batches
from lightning_oscars.core.slots import Blocks, SlotCursor, SlotInfo
from lightning_oscars.core.warmup import WarmupGate

__all__ = [
    "EpochOrder",
    "EpochSampler",
    "LoadBalancedLoader",
    "SlotInfo",
    "block_widths",
    "empty_batch",
    "inner_loader_kwargs",
    "training_set_size",
]  # EpochOrder: see epoch_order.py


class LoadBalancedLoader:
    """Wraps the user's training ``DataLoader``; see the module docstring.

    Args:
        dataloader: the user's loader; its dataset, batch size, ``drop_last`` and worker settings are used.
        rank, world_size: this process's place among the replicas (its replica, and how many there are).
        shuffle, seed: without ``order``: shuffle the epoch (seeded by ``seed + epoch``, identical on every rank).
        batches_per_slot: ``accumulate_grad_batches``.
        order: the epoch order (see :class:`EpochOrder`); overrides ``shuffle`` and ``seed``.
        replica_size, member: the ranks per replica and this rank's place in its replica (``replicas.py``): the
            plan's batches are replica batches of ``replica_size`` user batches, of which this rank fetches its part.
        batch_sizes: every replica's own batch size per rank (instead of the loader's ``batch_size``).
    """

    def __init__(
        self,
        dataloader: Any,  # a DataLoader, or an iterable of its own batches (loader_shape.py)
        rank: int,
        world_size: int,
        shuffle: bool = False,
        seed: int = 0,
        batches_per_slot: int = 1,
        order: EpochOrder | None = None,
        replica_size: int = 1,
        member: int = 0,
        batch_sizes: Sequence[int] | None = None,
    ) -> None:
        # The unit of the partition: a sample, or one of the user's batches kept whole (loader_shape.py).
        self.shape = loader_shape(dataloader)
        self._driven = batch_source(dataloader, self.shape, seed if order is None else order.seed, world_size)
        size = self._driven.num_batches if self._driven is not None else training_set_size(dataloader)
        dataset = getattr(dataloader, "dataset", None)  # an iterable of its own batches has none
        check_unit_loader(self.shape, batch_sizes, replica_size)
        if order is None:
            order = EpochOrder("permutation" if shuffle else "sequential", size, seed)
        self.order = order
        self.dataset: Dataset | None = dataset
        self._size_batches(dataloader, batch_sizes, world_size, replica_size)
        self.num_samples = order.num_samples
        if not 0 <= member < replica_size:
            raise ValueError(f"member {member} outside a replica of {replica_size} ranks")
        self.layout = ReplicaLayout(replica_size, replica_size)
        self.member = member
        # The plan's batches: a replica's (replica_size of the user's batches; the user's own when it is 1).
        self.num_batches = replica_batches(self.num_samples, self.batch_size, replica_size, self.drop_last)
        self.rank = rank
        self.world_size = world_size
        self.batches_per_slot = 1
        self.set_batches_per_slot(batches_per_slot)
        self.sampler = EpochSampler()
        self._loader_kwargs = loader_kwargs = inner_loader_kwargs(dataloader)
        self.uses_workers = loader_kwargs.get("num_workers", 0) > 0
        self._feed = UnitFeed()
        self._inner_loader = self._new_inner_loader()
        self.plan: EpochPlan | None = None
        self.pacer: DeadlinePacer | None = None  # decides the real slots of deadline rounds (set by the strategy)
        self.warmup_gate: WarmupGate | None = None  # decides those of the time-boxed warm-up round (likewise)
        self.start_position = 0  # set by the strategy when Lightning resumes mid-epoch
        self._order: list[int] | None = None
        self._order_epoch = -1
        # What each yielded batch is, in yield order. The batch itself stays the user's (their
        # on_before_batch_transfer hook sees it unwrapped); Lightning prefetches, so the strategy takes the
        # info of the batch it is about to run with take_slot(), which may lag the last yield by a batch.
        self._slots: deque[SlotInfo] = deque()
        self._running = SlotInfo(False, 0)  # the slot taken last: the one Lightning runs now
        self._iterator: _EpochIterator | None = None  # the epoch being fetched
        # Another loader of a combined step that decides this one's slots, and this one's batch for its (combined.py).
        self.lead: LoadBalancedLoader | None = None
        self.follow: Callable[[int], int | None] = lambda b: b

    def _size_batches(
        self, dataloader: DataLoader, batch_sizes: Sequence[int] | None, world_size: int, replica_size: int
    ) -> None:
        """The samples of one of the plan's batches (``batch_size``), per-rank widths and ``drop_last``."""
        if self.shape == "samples":
            # With per-rank batch sizes the plan's batches are blocks, ``widths[rank]`` of them per batch of a rank.
            batch_size = int(dataloader.batch_size)  # type: ignore[arg-type]
            self.batch_size, self.widths = plan_batches(batch_size, batch_sizes, world_size, replica_size)
            self.drop_last = bool(dataloader.drop_last)
            return
        # One of the plan's batches is one of the user's, which drops (or keeps) its own remainder.
        if self.order.kind != ("sequential" if self._driven is not None else "units"):
            raise ValueError(f"a loader of the user's batches needs their order, not a {self.order.kind!r} one")
        self.batch_size, self.widths, self.drop_last = 1, None, False

    def set_batches_per_slot(self, batches_per_slot: int) -> None:
        """Units of ``batches_per_slot`` batches (``accumulate_grad_batches``, which a callback may change
        between epochs). The fit session sets :attr:`max_slots` again afterwards."""
        if batches_per_slot < 1:
            raise ValueError(f"batches_per_slot must be >= 1, got {batches_per_slot}")
        self.batches_per_slot = batches_per_slot
        self.total_units = math.ceil(self.num_batches / batches_per_slot)
        # Slots per epoch that no schedule exceeds; the strategy tightens it (see max_epoch_slots).
        self.max_slots = self.total_units
        if self.total_units < self.world_size:
            k = self.layout.replica_size
            who = f"{self.world_size} replicas of {k} ranks" if k > 1 else f"{self.world_size} ranks"
            raise ValueError(
                f"The training set has {self.num_samples} samples: {self.num_batches} batches of"
                f" {self.batch_size * k} in units of {batches_per_slot} (accumulate_grad_batches), fewer than one"
                f" optimizer step for each of the {who} per epoch. Use a smaller batch size or fewer ranks."
            )

    def units_within(self, limit: float) -> int:
        """The units an epoch plans under a fractional ``limit_train_batches``: as many batches as ddp trains on all
        ranks together (each rank ``limit`` of its ``DistributedSampler`` shard's batches), taken from the start of
        the epoch's order. An int limit caps the epoch's batches as Lightning counts them (the strategy's
        ``size_epoch``), over the whole epoch's plan."""
        if isinstance(limit, int) or limit == 1.0:
            return self.total_units
        ranks = self.world_size * self.layout.replica_size  # ddp's world: every rank of every replica
        per_rank = math.ceil(self.num_samples / ranks)  # DistributedSampler pads the last shard
        rank_batches = per_rank // self.batch_size if self.drop_last else math.ceil(per_rank / self.batch_size)
        limited = int(rank_batches * limit)
        if limited < 1:
            raise ValueError(
                f"limit_train_batches={limit} leaves no training batch: each of the {ranks} ranks would"
                f" have {rank_batches} batches under ddp, and {limit} of them is less than one."
            )
        units = math.ceil(limited * ranks / (self.batches_per_slot * self.layout.replica_size))
        return min(self.total_units, max(units, self.world_size))

    def __len__(self) -> int:
        # An upper bound: the strategy shortens each epoch to its plan through trainer.num_training_batches.
        return self.max_slots * self.batches_per_slot

    @property
    def has_pending_slot(self) -> bool:
        return bool(self._slots)

    def take_slot(self) -> SlotInfo:
        """What the oldest batch yielded and not yet taken is: called once per batch as it starts its step."""
        self._running = self._slots.popleft()
        return self._running

    def continues_round(self) -> bool:
        """Whether this rank's next slot is a real step of the round of the slot running now: the fetched one if
        Lightning fetched ahead, else the next slot decided now (``SlotCursor.decide_ahead``; Lightning fetches a
        sized loader's next batch after the running batch's hooks)."""
        running = self._running.round_slot
        if self._slots:
            return any(info.real and info.round_slot == running for info in self._slots)
        iterator = self._iterator
        if iterator is None or not 0 <= iterator.position < len(self):
            return False
        return iterator.cursor.decide_ahead(iterator.position, running)

    def close_round(self) -> None:
        """Take no further real step in the deadline round of the slot running now: its slots fetched but not run
        become no-ops, and so does every later slot of it; the units they held count as not reached, so settling
        the round hands them back to the epoch. A plain round (its units are not handed back) is left as planned."""
        iterator, plan, running = self._iterator, self.plan, self._running.round_slot
        if iterator is None or plan is None or not 0 <= running < plan.total_slots:
            return
        rnd = plan.round_at(running)
        if not rnd.deadline or rnd.start_slot != running:
            return
        self._slots = iterator.cursor.close_round(running, self._slots, iterator.position)

    def start_epoch(self, plan: EpochPlan, epoch: int, order: Sequence[int] | None, start_position: int = 0) -> None:
        """Hand the loader an epoch: its plan, its order of samples (``None``: draw it here) and the Lightning
        batch to start from (non-zero when resuming mid-epoch)."""
        self.plan = plan
        self.sampler.epoch = epoch
        self._order = list(order) if order is not None else self.order.draw(epoch)
        if len(self._order) != self.num_samples:
            raise ValueError(f"an epoch order of {len(self._order)} samples for a loader of {self.num_samples}")
        self._order_epoch = epoch
        self.start_position = start_position
        if self._driven is not None:
            self._driven.start_epoch(epoch)

    def epoch_order(self, epoch: int) -> list[int]:
        if self._order is None or self._order_epoch != epoch:
            self._order, self._order_epoch = self.order.draw(epoch), epoch
        return self._order

    def fetch(self, batches: Sequence[Sequence[Any]]) -> Iterator[Any]:
        """(Re)start the inner loader on ``batches`` (each the units of one batch: sample indices, or the user's
        batches); the same worker processes when persistent."""
        if self._driven is not None:
            return self._driven.fetch([units[0] for units in batches])
        self._feed.batches = feed_batches(batches, self.shape)
        assert self._inner_loader is not None
        return iter(self._inner_loader)

    def fetch_one(self, indices: Sequence[Any]) -> Any:
        """One batch outside the epoch's stream, in this process (no worker start-up for a single batch)."""
        if self._driven is not None:
            return self._driven.batch_at(indices[0])
        kwargs = {k: v for k, v in self._loader_kwargs.items() if k in ("collate_fn", "pin_memory")}
        return next(iter(inner_loader(self.dataset, feed_batches([indices], self.shape), self.shape, kwargs)))

    def __iter__(self) -> Iterator[Any]:
        self._iterator = _EpochIterator(self)
        return self._iterator

    def decision_at(self, position: int) -> tuple[Blocks | None, int]:
        """This (lead) loader's decision for Lightning batch ``position`` of the epoch being fetched."""
        assert self._iterator is not None, "the lead of a combined loader is iterated with its followers"
        return self._iterator.decision(position)

    def close(self) -> None:
        """Let go of the epoch being fetched and the inner loader's iterator, so that their worker processes exit now
        (the loader can be iterated again, with new workers). Left to
        a garbage-collection pass (the loader and its epoch iterator refer to each other), a worker's shutdown can
        find its queues already finalised and wait out DataLoader's 5 s join timeout per worker."""
        iterator, self._iterator = self._iterator, None
        if iterator is not None:
            iterator.close()
        self._slots.clear()
        if self._driven is not None:
            self._driven.close()
        # Persistent workers live as long as their DataLoader: a fresh one (no worker until iterated) lets them go.
        self._inner_loader = self._new_inner_loader()

    def _new_inner_loader(self) -> DataLoader | None:
        """The inner loader over the user's dataset (none where the user's loader makes its own batches)."""
        if self._driven is not None:
            return None
        return inner_loader(self.dataset, self._feed, self.shape, self._loader_kwargs)


class _EpochIterator:
    """One pass over the epoch: the cursor decides every slot (``slots.py``); this fetches and yields."""

    def __init__(self, owner: LoadBalancedLoader) -> None:
        self.owner = owner
        # Index of the next Lightning batch in the epoch. Read at the first batch, not here: when resuming
        # mid-epoch Lightning creates the iterator before the strategy learns the restored position.
        self.position = -1
        self.last_batch: Any = None
        self.cursor = SlotCursor(owner)
        self._inner: Iterator[Any] | None = None
        self._inner_version = -1
        self._fresh_inner = False
        self._decided: dict[int, tuple[Blocks | None, int]] = {}
        if owner.lead is None:
            owner._slots.clear()

    def _indices(self, blocks: Blocks) -> list[int]:
        owner = self.owner
        size = owner.batch_size * owner.layout.replica_size
        order = owner.epoch_order(owner.sampler.epoch)
        indices: list[int] = []
        for batch in blocks:
            start = batch * size
            # The epoch's last batch keeps the remainder (replica_batches may have merged a too small one into it).
            end = owner.num_samples if batch == owner.num_batches - 1 and not owner.drop_last else start + size
            first, last = owner.layout.member_span(start, min(end, owner.num_samples), owner.member)
            indices += order[first:last]
        return indices

    def _restart_inner(self) -> None:
        owner = self.owner
        plan = owner.plan
        assert plan is not None
        self._inner = owner.fetch([self._indices(batch) for batch in self.cursor.upcoming_batches(self.position)])
        self._inner_version = plan.version
        self._fresh_inner = True
        self.cursor.stale = False

    def _real_batch(self, indices: list[int]) -> tuple[Any, float | None]:
        owner = self.owner
        if owner.plan is None or owner.lead is not None:  # a follower fetches each of its batches when asked
            started = time.perf_counter()
            return owner.fetch_one(indices), time.perf_counter() - started
        if self._inner is None or self._inner_version != owner.plan.version or self.cursor.stale:
            self._restart_inner()
        assert self._inner is not None
        started = time.perf_counter()
        item = next(self._inner)
        seconds: float | None = time.perf_counter() - started
        if self._fresh_inner and owner.uses_workers:
            seconds = None  # worker start-up or the prefetch pipeline refilling: not a step's data loading
        self._fresh_inner = False
        return item, seconds

    def close(self) -> None:
        self._inner = None  # the last reference: its workers are shut down here, not by the garbage collector

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        owner = self.owner
        if self.position < 0:
            self.position, owner.start_position = owner.start_position, 0
        if self.position >= len(owner):
            raise StopIteration
        lead = owner.lead
        batch, round_slot = self.decision(self.position) if lead is None else lead.decision_at(self.position)
        if lead is not None and batch is not None:  # a follower: its own batches for the lead's (combined.py)
            mapped = [owner.follow(b) for b in batch]
            if any(b is None for b in mapped):  # past its end in "max_size": no batch, as under ddp
                self.position += 1
                return None
            batch = tuple(b for b in mapped if b is not None)
        if batch is None:
            if self.last_batch is None:
                # Only when resuming into a no-op slot: Lightning skips a None batch entirely (no step, no
                # counters), so build the empty batch from a real batch of this rank's data, fetched once.
                self.last_batch = owner.fetch_one(self._indices((min(owner.rank, owner.num_batches - 1),)))
            item = empty_batch(self.last_batch)
            info = SlotInfo(False, 0, 0.0, round_slot)
        else:
            indices = self._indices(batch)
            item, seconds = self._real_batch(indices)
            samples = len(indices) if owner.shape == "samples" else sum(unit_samples(u) for u in indices)
            if owner.shape in ("driven", "own"):
                samples = batch_rows(item)
            info = SlotInfo(True, samples, seconds, round_slot)
            self.last_batch = item
        self.position += 1
        if lead is None:  # the strategy takes the lead's slots; a follower's are the same
            owner._slots.append(info)
        return item

    def decision(self, position: int) -> tuple[Blocks | None, int]:
        """The cursor's decision for ``position``, made once and kept for the followers that ask after it."""
        decided = self._decided.get(position)
        if decided is None:
            owner = self.owner
            decided = self._decided[position] = self.cursor.decide(position, sum(1 for i in owner._slots if i.real))
            self._decided.pop(position - 2, None)
        return decided
