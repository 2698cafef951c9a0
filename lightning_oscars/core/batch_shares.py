"""Balancing by batch size: how a global batch is split among ranks of different speeds and memories.

Under batch balancing every step is one gradient all-reduce over a global batch of ddp's size (``batch_size`` times
the world); each rank takes a share sized to its speed, within its memory cap, so that every rank finishes its part
of the step at about the same time. A step's time on a rank grows with its batch, as on a GPU: ``a + b * n`` for
``n`` samples (:class:`BatchTimeModel`, fitted to the measured steps). :func:`solve_shares` gives each rank a whole
number of samples, the shares summing to the global batch, that minimises the slowest rank's predicted time.
:func:`share_span` says which positions of a global batch a rank takes, so that the union over ranks is exactly
ddp's global batch. :func:`resolve_batch_sizes` reads the per-rank caps a user gives. Pure arithmetic: no Lightning,
no torch.distributed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["BatchTimeModel", "resolve_batch_sizes", "share_span", "solve_shares", "split_last_batch"]


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


def solve_shares(total: int, models: Sequence[BatchTimeModel], caps: Sequence[int] | None = None) -> list[int]:
    """Whole shares of a global batch of ``total`` samples, one per rank, summing to ``total``, each within its cap,
    that minimise the slowest rank's predicted step time. A rank may get no sample only when ``total`` is smaller
    than the world (every rank gets one otherwise: a rank with nothing to step on would skip ddp's all-reduce)."""
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
    floor = 1 if total >= world else 0
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


def split_last_batch(shares: Sequence[int], samples: int) -> list[int]:
    """The shares of a global batch cut short to ``samples`` (the epoch's remainder), in the full batch's
    proportions (largest remainders), each rank keeping at least one sample while there are enough."""
    total = sum(shares)
    if samples >= total:
        return list(shares)
    world = len(shares)
    floor = 1 if samples >= world else 0
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
