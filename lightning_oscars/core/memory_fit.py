"""How large a batch fits a device's memory: the arithmetic behind ``batch_sizes="auto"``.

A training step's peak memory is close to linear in its batch: a part that does not grow with it (weights, their
gradients, the optimizer's state, the framework's workspace) and activations kept for the backward pass, a fixed
number of bytes per sample for a given model and input shape. :class:`MemoryModel` is that line, fitted to peaks
measured at a few batch sizes; :meth:`MemoryModel.largest_batch` is where it meets the device's capacity, less a
margin (the allocator's fragmentation, a longer sample, the next step's temporaries). What is measured where is the
glue's (``lightning/batch_probe.py``); this module is pure arithmetic and unit-tested directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MemoryModel", "scaled_batch_sizes"]


@dataclass(frozen=True)
class MemoryModel:
    """Peak bytes of a training step of ``n`` samples: ``fixed + per_sample * n``."""

    fixed: float
    per_sample: float

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]]) -> MemoryModel:
        """Least squares through ``(batch size, peak bytes)`` points of at least two distinct sizes."""
        sizes = [float(n) for n, _ in points]
        if len(set(sizes)) < 2:
            raise ValueError(f"a memory model needs peaks at two batch sizes or more, got {list(points)}")
        mean_n = sum(sizes) / len(sizes)
        mean_m = sum(m for _, m in points) / len(points)
        spread = sum((n - mean_n) ** 2 for n in sizes)
        slope = sum((n - mean_n) * (m - mean_m) for n, (_, m) in zip(sizes, points)) / spread
        slope = max(slope, 0.0)  # a batch never needs less memory than a smaller one
        return cls(fixed=mean_m - slope * mean_n, per_sample=slope)

    def peak(self, n: int) -> float:
        return self.fixed + self.per_sample * n

    def largest_batch(self, capacity: float, reserved: float = 0.0, margin: float = 0.1, limit: int = 1 << 20) -> int:
        """The largest batch whose peak, plus ``reserved`` bytes not yet allocated (the optimizer's state before its
        first step), stays within ``(1 - margin)`` of ``capacity``; at most ``limit``. 0 when not even one sample
        fits."""
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"the memory margin must be in [0, 1), got {margin}")
        room = capacity * (1.0 - margin) - reserved - self.fixed
        if room < self.per_sample:
            return 0
        if self.per_sample <= 0:
            return limit
        return min(limit, int(math.floor(room / self.per_sample)))


def scaled_batch_sizes(fits: Sequence[int], batch_size: int) -> list[int]:
    """Per-rank batch sizes for local steps from the largest batch that fits each rank (``fits``): the rank that fits
    the least trains the user's ``batch_size`` (or its fit, if smaller), every other rank that batch scaled by how
    much more it fits. So memory 2:1 gives batches 2:1 around the size the user tuned, not each device's maximum
    (which would change the optimisation far more than the memory asks)."""
    if not fits or min(fits) < 1:
        raise ValueError(f"every rank must fit a batch of at least one sample, got {list(fits)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    base = min(batch_size, min(fits))
    return [min(fit, max(1, base * fit // min(fits))) for fit in fits]
