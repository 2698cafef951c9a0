"""Balancing by batch size: how a global batch is split among ranks of different speeds and memories.

Under batch balancing every step is one gradient all-reduce over a global batch of ddp's size (``batch_size`` times
the world); each rank takes a share sized to its speed, within its memory cap, so that every rank finishes its part
of the step at about the same time. A step's time on a rank grows with its batch, as on a GPU: ``a + b * n`` for
``n`` samples (:class:`BatchTimeModel`, fitted to the measured steps). :func:`solve_shares` gives each rank a whole
number of samples, the shares summing to the global batch, that minimises the slowest rank's predicted time.
:func:`share_span` says which positions of a global batch a rank takes, so that the union over ranks is exactly
ddp's global batch. :func:`resolve_batch_sizes` reads the per-rank caps a user gives. :class:`ShareSchedule` is the
fit's agreed shares, batch by batch (a change takes effect a few batches ahead, beyond what the loader has already
fetched); :class:`ShareBalancer` fits each rank's time model to the measured steps and proposes new shares when they
are predicted to be faster. Pure arithmetic: no Lightning, no torch.distributed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "BatchTimeModel",
    "ShareBalancer",
    "ShareSchedule",
    "resolve_batch_sizes",
    "share_span",
    "solve_shares",
    "split_last_batch",
]


@dataclass(frozen=True)
class BatchTimeModel:
    """One rank's seconds per step for a batch of ``n`` samples: ``fixed + per_sample * n``."""

    fixed: float
    per_sample: float

    def __post_init__(self) -> None:
        if not (self.fixed >= 0 and self.per_sample > 0 and math.isfinite(self.fixed + self.per_sample)):
            raise ValueError(f"a step time model needs fixed >= 0 and per_sample > 0, got {self}")

    def time(self, samples: int) -> float:
        return self.fixed + self.per_sample * samples

    @classmethod
    def fit(cls, samples: Sequence[int], seconds: Sequence[float]) -> BatchTimeModel:
        """Least squares over measured steps of ``samples[j]`` samples taking ``seconds[j]``. With one batch size only
        the split of the time into its fixed and per-sample parts is unknown: the time is taken as proportional to the
        batch (``fixed = 0``), which shifts work towards the fast ranks until two sizes have been seen."""
        if len(samples) != len(seconds) or not samples:
            raise ValueError(f"{len(samples)} batch sizes for {len(seconds)} step times")
        n = len(samples)
        mean_x, mean_y = sum(samples) / n, sum(seconds) / n
        spread = sum((x - mean_x) ** 2 for x in samples)
        if spread > 0:
            slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(samples, seconds)) / spread
            if slope > 0:
                fixed = mean_y - slope * mean_x
                if fixed >= 0:
                    return cls(fixed, slope)
        return cls(0.0, max(mean_y, 1e-12) / max(mean_x, 1e-12))


def solve_shares(
    total: int, models: Sequence[BatchTimeModel], caps: Sequence[int] | None = None, floor: int = 1
) -> list[int]:
    """Whole shares of a global batch of ``total`` samples, one per rank, summing to ``total``, each within its cap,
    that minimise the slowest rank's predicted step time. Every rank gets at least ``floor`` samples while the batch
    and the caps allow (a rank with nothing to step on would skip ddp's all-reduce; BatchNorm cannot train on one
    sample), else one, else none (``total`` smaller than the world)."""
    world = len(models)
    caps = [total] * world if caps is None else [int(c) for c in caps]
    if len(caps) != world:
        raise ValueError(f"{len(caps)} batch size caps for {world} ranks")
    if any(c < 1 for c in caps):
        raise ValueError(f"every rank's batch size cap must be at least 1, got {caps}")
    if sum(caps) < total:
        raise ValueError(
            f"the ranks' batch size caps {caps} hold {sum(caps)} samples, fewer than the global batch of {total}:"
            " raise a cap or lower batch_size"
        )
    floor = max(1, min([floor, total // world, *caps])) if total >= world else 0
    shares = [floor] * world
    # Greedy by the time each next sample would end at: exact for times linear in the share (each step adds the
    # sample where the resulting slowest time grows least), O(total * log world).
    heap = [(models[i].time(shares[i] + 1), i) for i in range(world) if shares[i] < caps[i]]
    heapq.heapify(heap)
    for _ in range(total - floor * world):
        end, i = heapq.heappop(heap)
        shares[i] += 1
        if shares[i] < caps[i]:
            heapq.heappush(heap, (models[i].time(shares[i] + 1), i))
    return shares


def split_last_batch(shares: Sequence[int], samples: int, floor: int = 1) -> list[int]:
    """The shares of a global batch cut short to ``samples`` (the epoch's remainder), in the full batch's
    proportions (largest remainders), each rank keeping at least ``floor`` samples while there are enough (else one,
    else none)."""
    total = sum(shares)
    if samples >= total:
        return list(shares)
    world = len(shares)
    floor = max(1, min([floor, samples // world, *shares])) if samples >= world else 0
    exact = [floor + (samples - floor * world) * s / total for s in shares]
    cut = [min(int(x), s) for x, s in zip(exact, shares)]
    while sum(cut) < samples:  # the samples left go where the cut falls furthest below its part, within the shares
        i = max((i for i in range(world) if cut[i] < shares[i]), key=lambda i: (exact[i] - cut[i], -i))
        cut[i] += 1
    return cut


def share_span(start: int, shares: Sequence[int], rank: int) -> tuple[int, int]:
    """Rank ``rank``'s positions of the global batch that begins at position ``start`` of the epoch's order: the
    ranks' shares laid side by side in rank order (their union is the global batch, whatever the shares)."""
    first = start + sum(shares[:rank])
    return first, first + shares[rank]


def resolve_batch_sizes(
    spec: Sequence[int] | Mapping[str, int] | None, world_size: int, device_names: Sequence[str]
) -> list[int] | None:
    """Per-rank batch size caps from ``batch_sizes=``: a list (one per rank), or a dict by device name (each rank's
    ``device_names[rank]``, e.g. ``torch.cuda.get_device_name()``); ``None``: no caps."""
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        missing = sorted({name for name in device_names if name not in spec})
        if missing:
            raise ValueError(
                f"batch_sizes has no entry for the device(s) {missing}; it names {sorted(spec)}. Add them, or give a"
                " list with one batch size per rank."
            )
        caps = [spec[name] for name in device_names]
    elif isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence):
        raise ValueError(f"batch_sizes must be a list (one per rank) or a dict by device name, got {spec!r}")
    else:
        caps = list(spec)
        if len(caps) != world_size:
            raise ValueError(f"batch_sizes has {len(caps)} entries for {world_size} ranks: give one per rank")
    for cap in caps:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"every batch size in batch_sizes must be an integer of at least 1, got {caps}")
    return caps


BatchKey = tuple[int, int]  # (epoch, batch index in the epoch): the order in which every rank runs the batches


class ShareSchedule:
    """Every rank's share of each global batch of a fit, the same on every rank.

    A change is made at one batch and takes effect at a later one (``(epoch, batch)`` keys, in the order the batches
    run), so that a loader which has already fetched the next few batches fetched them under the shares they run
    with. Shares hold from their key on, across epochs, until the next change."""

    def __init__(self, initial: Sequence[int]) -> None:
        if not initial or any(n < 0 for n in initial) or sum(initial) < 1:
            raise ValueError(f"initial shares must be non-negative with a positive sum, got {list(initial)}")
        self.total = sum(initial)
        self.changes: list[tuple[BatchKey, tuple[int, ...]]] = [((-1, 0), tuple(initial))]

    @property
    def world(self) -> int:
        return len(self.changes[0][1])

    @property
    def latest(self) -> tuple[int, ...]:
        return self.changes[-1][1]

    def shares_at(self, key: BatchKey) -> tuple[int, ...]:
        """The shares of the global batch ``key`` (the last change at or before it)."""
        for at, shares in reversed(self.changes):
            if at <= key:
                return shares
        return self.changes[0][1]

    def change(self, at: BatchKey, shares: Sequence[int]) -> None:
        """From batch ``at`` on, ``shares`` (summing to the global batch). ``at`` may not precede the last change."""
        shares = tuple(int(n) for n in shares)
        if len(shares) != self.world or sum(shares) != self.total or min(shares) < 0:
            raise ValueError(f"shares {list(shares)} do not split a global batch of {self.total} among {self.world}")
        if at < self.changes[-1][0]:
            raise ValueError(f"a change at {at} precedes the last one at {self.changes[-1][0]}")
        if shares != self.latest:
            self.changes.append((at, shares))


class ShareBalancer:
    """Proposes shares of a global batch of ``total`` samples from the ranks' measured steps.

    Every rank feeds it the same agreed measures (each rank's samples and seconds of its own work per step, waits
    left out), so every rank proposes the same shares. Per rank and batch size it keeps a moving average of the
    seconds (``smoothing``: the newest step's weight); a rank's :class:`BatchTimeModel` is fitted to those averages
    (one size seen: time taken as proportional to the batch). After ``warmup_steps`` measured steps, and every
    ``warmup_steps`` after, it solves the shares again and proposes them when they are predicted to make the step at
    least ``min_gain`` faster than the current shares, under the same models (hysteresis: noise does not move them).
    ``pinned``: every rank's seconds per step at ``batch_size`` samples, fixed (no measuring; time proportional to
    the batch)."""

    def __init__(
        self,
        total: int,
        world: int,
        caps: Sequence[int] | None = None,
        warmup_steps: int = 4,
        min_gain: float = 0.02,
        smoothing: float = 0.5,
        pinned: Sequence[float] | None = None,
    ) -> None:
        self.total, self.world = total, world
        self.caps = None if caps is None else list(caps)
        self.every = max(1, warmup_steps)
        self.min_gain, self.smoothing = min_gain, smoothing
        self.pinned = None if pinned is None else list(pinned)
        self.floor = 2  # BatchNorm cannot train on one sample
        if self.pinned is not None and len(self.pinned) != world:
            raise ValueError(f"{len(self.pinned)} pinned step times for {world} ranks")
        self._seconds: list[dict[int, float]] = [{} for _ in range(world)]  # per rank: batch size -> moving average
        self._since_solve = 0

    def initial(self) -> list[int]:
        """The first shares: the pinned speeds' split, else ddp's equal split (within the caps)."""
        if self.pinned is not None:
            batch = self.total / self.world
            return solve_shares(
                self.total, [BatchTimeModel(0.0, max(t, 1e-12) / batch) for t in self.pinned], self.caps
            )
        return solve_shares(self.total, [BatchTimeModel(0.0, 1.0)] * self.world, self.caps, self.floor)

    def models(self) -> list[BatchTimeModel] | None:
        """Every rank's fitted time model (``None`` until every rank has a measure)."""
        if any(not seen for seen in self._seconds):
            return None
        return [BatchTimeModel.fit(list(seen), list(seen.values())) for seen in self._seconds]

    def observe(self, samples: Sequence[int], seconds: Sequence[float], current: Sequence[int]) -> list[int] | None:
        """One step's measures (``samples[r]`` samples took rank ``r`` ``seconds[r]``; a rank with no measure has
        ``seconds[r] <= 0``); returns new shares when it is time to re-solve and they beat ``current``, else
        ``None``."""
        if self.pinned is not None:
            return None
        for rank, (n, s) in enumerate(zip(samples, seconds)):
            if n > 0 and s > 0 and math.isfinite(s):
                seen = self._seconds[rank]
                seen[n] = s if n not in seen else (1 - self.smoothing) * seen[n] + self.smoothing * s
        self._since_solve += 1
        if self._since_solve < self.every:
            return None
        self._since_solve = 0
        return self.propose(current)

    def propose(self, current: Sequence[int]) -> list[int] | None:
        """The solved shares if they beat ``current`` by ``min_gain`` under the fitted models, else ``None``."""
        models = self.models()
        if models is None:
            return None
        proposed = solve_shares(self.total, models, self.caps, self.floor)
        now = max(m.time(n) for m, n in zip(models, current))
        then = max(m.time(n) for m, n in zip(models, proposed))
        return proposed if then < (1 - self.min_gain) * now else None
