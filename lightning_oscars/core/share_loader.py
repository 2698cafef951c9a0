"""The training loader of batch balancing: every rank's share of ddp's global batches, one per step.

ddp with ``batch_size`` ``B`` on ``W`` ranks trains, at step ``j`` of an epoch, the samples at positions
``[j*B*W, (j+1)*B*W)`` of the epoch's order (``DistributedSampler`` deals position ``r + W*k`` to rank ``r``, and
rank ``r``'s batch ``j`` holds its positions ``k`` in ``[j*B, (j+1)*B)``). :class:`ShareLoader` yields, at step
``j``, this rank's span of that same global batch under the step's shares (``batch_shares.share_span``), so the
union over ranks is ddp's global batch whatever the shares, and an epoch trains every sample once (no padding: the
last global batch is short, split in the shares' proportions; a remainder smaller than the world joins the batch
before it, so that no rank steps on nothing). Every rank yields the same number of batches, so Lightning's counters
agree as under ddp.

The shares come from a :class:`~lightning_oscars.core.batch_shares.ShareSchedule` read as each batch is fetched; a
re-balance takes effect :attr:`ShareLoader.lag` batches ahead, beyond what the inner ``DataLoader``'s workers and
Lightning's fetcher may already hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import DataLoader

from lightning_oscars.core.batch_shares import BatchKey, ShareSchedule, share_span, split_last_batch
from lightning_oscars.core.epoch_order import EpochOrder
from lightning_oscars.core.loader import EpochSampler, inner_loader_kwargs

__all__ = ["ShareLoader", "epoch_batches", "rank_batch_size", "resumed_batches", "saved_position"]


def epoch_batches(samples: int, total: int, world: int, drop_last: bool) -> list[tuple[int, int]]:
    """The global batches of an epoch of ``samples`` samples: ``(first position, samples)`` each. Batches of
    ``total``; the remainder is a last, short batch (dropped with ``drop_last``), or joins the batch before it when it
    is smaller than the world (every rank must have a sample to step on)."""
    full, rest = divmod(samples, total)
    batches = [(j * total, total) for j in range(full)]
    if rest and not drop_last:
        if rest < world and batches:
            start, size = batches.pop()
            batches.append((start, size + rest))
        else:
            batches.append((full * total, rest))
    return batches


def resumed_batches(
    samples: int, total: int, world: int, drop_last: bool, start: int, position: int
) -> list[tuple[int, int]]:
    """An epoch resumed at batch ``start`` in a world other than the one that trained its first ``position`` samples
    (a restart after a lost rank, a checkpoint resumed on more or fewer ranks): ``start`` batches already done (held
    as ``(position, 0)``, never fetched: Lightning counts them as done), then global batches of ``total`` from
    ``position`` on, as :func:`epoch_batches` lays out the rest of the epoch."""
    rest = epoch_batches(samples - position, total, world, drop_last)
    return [(position, 0)] * start + [(position + first, size) for first, size in rest]


def saved_position(samples: int, drop_last: bool, saved: Mapping[str, Any], epoch: int, batch: int) -> int:
    """The samples of ``epoch`` trained before its batch ``batch`` in the world that wrote ``saved`` (a checkpoint's
    ``world``, ``total`` and ``resumed``, as :meth:`ShareLoader.layout` laid the epoch out there)."""
    total, world, resumed = int(saved["total"]), int(saved["world"]), saved.get("resumed")
    if resumed is not None and resumed[0] == epoch:
        layout = resumed_batches(samples, total, world, drop_last, int(resumed[1]), int(resumed[2]))
    else:
        layout = epoch_batches(samples, total, world, drop_last)
    return layout[batch][0] if batch < len(layout) else samples


class _ShareBatches:
    """The inner loader's batch sampler: this rank's index lists from a batch on, shares read as each is drawn."""

    def __init__(self, owner: ShareLoader, epoch: int, start: int) -> None:
        self.owner, self.epoch, self.start = owner, epoch, start

    def __len__(self) -> int:
        return max(0, len(self.owner) - self.start)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in range(self.start, len(self.owner)):
            yield self.owner.indices(self.epoch, batch)


class _LazyEpoch:
    """An epoch's iterator that starts at its first batch: Lightning makes the first epoch's (and a resumed one's)
    before its counters are final (a fit resumed at an epoch's end runs the next epoch on it)."""

    def __init__(self, owner: ShareLoader) -> None:
        self.owner = owner
        self._inner: Iterator[Any] | None = None

    def __iter__(self) -> _LazyEpoch:
        return self

    def __next__(self) -> Any:
        if self._inner is None:
            self._inner = self.owner.open_epoch()
        return next(self._inner)


def rank_batch_size(dataloader: DataLoader) -> int:
    """The user's per-rank ``batch_size`` (ddp's), which batch balancing needs: a clear error without one."""
    if dataloader.batch_size is None:
        raise ValueError(
            "balance='batch' needs the training DataLoader's batch_size (each rank's, as under ddp); a custom"
            " batch_sampler is not supported. Pass batch_size=... (and drop_last) to the DataLoader instead."
        )
    return int(dataloader.batch_size)


class ShareLoader:
    """Wraps the user's training ``DataLoader`` for batch balancing; see the module docstring.

    Args:
        dataloader: the user's loader: its dataset, ``batch_size`` (per rank, as under ddp), ``drop_last``, workers.
        rank, world_size: this process's place.
        order: the epoch order of the user's sampler (``epoch_order.EpochOrder``).
        schedule: the fit's shares, batch by batch.
    """

    def __init__(self, dataloader: DataLoader, rank: int, world_size: int, order: EpochOrder, schedule: ShareSchedule):
        self.dataset = dataloader.dataset
        self.batch_size = rank_batch_size(dataloader)
        self.drop_last = bool(dataloader.drop_last)
        self.rank, self.world_size = rank, world_size
        self.order, self.schedule = order, schedule
        if schedule.total != self.batch_size * world_size or schedule.world != world_size:
            raise ValueError(f"a schedule of {schedule.total} samples for {world_size} ranks of {self.batch_size}")
        self.whole = epoch_batches(order.num_samples, schedule.total, world_size, self.drop_last)
        # (epoch, start batch, position): the epoch a resume in another world lays out by resumed_batches
        self.resumed: tuple[int, int, int] | None = None
        self._resumed_layout: list[tuple[int, int]] = []
        if not self.whole:
            raise ValueError(
                f"The training set has {order.num_samples} samples, fewer than one global batch of {schedule.total}"
                f" ({self.batch_size} per rank on {world_size} ranks) with drop_last=True: nothing to train."
            )
        kwargs = inner_loader_kwargs(dataloader)
        workers = kwargs.get("num_workers", 0)
        self._loader_kwargs = kwargs
        # Batches fetched ahead of the one running: the inner loader's workers' queue and Lightning's fetcher's one.
        self.lag = 2 + (workers * (kwargs.get("prefetch_factor") or 2) if workers else 0)
        self.sampler = EpochSampler()
        self.epoch = 0
        self.start_batch = 0  # set when Lightning resumes mid-epoch
        self._order: list[int] | None = None
        self._order_epoch = -1
        self._inner: Iterator[Any] | None = None
        # Called as each epoch's first batch is fetched, to hand over the epoch (``start_epoch``): the epoch, and the
        # batch a mid-epoch resume starts from, are final only then.
        self.before_epoch: Callable[[], None] | None = None

    def __len__(self) -> int:
        return len(self.layout(self.epoch))

    def layout(self, epoch: int) -> list[tuple[int, int]]:
        """The global batches of ``epoch``: ``(first position, samples)`` each."""
        if self.resumed is None or self.resumed[0] != epoch:
            return self.whole
        return self._resumed_layout

    def position(self, epoch: int, batch: int) -> int:
        """The samples of ``epoch``'s order trained before its batch ``batch``."""
        layout = self.layout(epoch)
        return layout[batch][0] if batch < len(layout) else self.order.num_samples

    def start_epoch(
        self, epoch: int, order: Sequence[int] | None = None, start_batch: int = 0, position: int | None = None
    ) -> None:
        """The epoch about to run, its order (``None``: drawn here) and the batch it starts from (a resume);
        ``position``: the samples trained before that batch, where another world trained them (``None``: this one)."""
        if position is not None and position != self.position(epoch, start_batch):
            self.resumed = (epoch, start_batch, position)
            total, world, samples = self.schedule.total, self.world_size, self.order.num_samples
            self._resumed_layout = resumed_batches(samples, total, world, self.drop_last, start_batch, position)
        self.epoch = self.sampler.epoch = epoch
        self._order = list(order) if order is not None else self.order.draw(epoch)
        if len(self._order) != self.order.num_samples:
            raise ValueError(f"an epoch order of {len(self._order)} samples for a loader of {self.order.num_samples}")
        self._order_epoch = epoch
        self.start_batch = start_batch

    def shares(self, epoch: int, batch: int) -> list[int]:
        """Every rank's samples in global batch ``batch`` of ``epoch`` (the last one's cut in proportion)."""
        shares = self.schedule.shares_at((epoch, batch))
        size = self.layout(epoch)[batch][1]
        if size == self.schedule.total:
            return list(shares)
        if size > self.schedule.total:  # a remainder smaller than the world joined this batch: one more each
            extra = size - self.schedule.total
            return [n + (1 if r < extra else 0) for r, n in enumerate(shares)]
        return split_last_batch(shares, size, floor=2)

    def indices(self, epoch: int, batch: int) -> list[int]:
        """This rank's sample indices in global batch ``batch`` of ``epoch``."""
        if self._order is None or self._order_epoch != epoch:
            self._order, self._order_epoch = self.order.draw(epoch), epoch
        first, last = share_span(self.layout(epoch)[batch][0], self.shares(epoch, batch), self.rank)
        return self._order[first:last]

    def change_key(self, now: BatchKey, batches_per_step: int = 1) -> BatchKey:
        """The first batch a change decided at batch ``now`` can take effect at: past the fetched ones, at an
        optimizer step's first batch (shares stay fixed within an accumulation of ``batches_per_step``)."""
        epoch, batch = now
        at = batch + self.lag
        return epoch, math.ceil(at / batches_per_step) * batches_per_step

    def __iter__(self) -> Iterator[Any]:
        return _LazyEpoch(self)

    def open_epoch(self) -> Iterator[Any]:
        """The epoch's batches from its start batch (the epoch handed over by ``before_epoch`` first)."""
        if self.before_epoch is not None:
            self.before_epoch()
        start, self.start_batch = self.start_batch, 0
        sampler = _ShareBatches(self, self.epoch, start)
        self._inner = iter(DataLoader(self.dataset, batch_sampler=sampler, **self._loader_kwargs))
        return self._inner

    def close(self) -> None:
        """Let the epoch's worker processes go now."""
        self._inner = None
