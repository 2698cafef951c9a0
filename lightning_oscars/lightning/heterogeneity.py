"""Rehearse a heterogeneous cluster on one machine: make chosen ranks k times slower.

:class:`HeterogeneityEmulator` measures how long each training batch of its own rank takes and then sleeps
``(k - 1)`` times that long, so the rank behaves like a device ``k`` times slower whatever the model. The
factor may change over time (a neighbour starts sharing the GPU, thermal throttling) and may jitter.
Works with any strategy, so ``ddp`` and ``oscars`` can be compared on the same emulated cluster.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from typing import Any, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

__all__ = ["HeterogeneityEmulator", "SlowdownProfile"]

ProfileSpec = Union[float, Sequence[tuple[float, float]]]


class SlowdownProfile:
    """A slowdown factor over time: ``[(0, 1.0), (30, 3.0)]`` means normal speed, then 3x slower after 30 s
    of training. A plain number is a constant factor."""

    def __init__(self, spec: ProfileSpec) -> None:
        if isinstance(spec, (int, float)):
            steps = [(0.0, float(spec))]
        else:
            steps = sorted((float(t), float(f)) for t, f in spec)
        if not steps:
            raise ValueError("a slowdown profile needs at least one (seconds, factor) entry")
        for t, f in steps:
            if not (t >= 0.0 and f >= 1.0) or f != f:
                raise ValueError(f"slowdown entry ({t}, {f}): times must be >= 0 and factors >= 1")
        self.steps = steps

    def factor_at(self, elapsed: float) -> float:
        factor = self.steps[0][1]
        for start, value in self.steps:
            if elapsed >= start:
                factor = value
        return factor


class HeterogeneityEmulator(Callback):
    """Make ranks slower by sleeping in proportion to their own measured batch time.

    Args:
        slowdown: ``{rank: factor}`` or ``{rank: [(seconds, factor), ...]}``; ranks not listed run at full speed.
        jitter: relative noise on every sleep (0.1 = +-10%, uniform), seeded per rank.
        seed: seed of the jitter.

    Attributes:
        slept: total seconds this rank slept.
    """

    def __init__(self, slowdown: Mapping[int, ProfileSpec], jitter: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"jitter must lie in [0, 1), got {jitter!r}")
        self.profiles = {int(rank): SlowdownProfile(spec) for rank, spec in slowdown.items()}
        self.jitter = jitter
        self.seed = seed
        self.slept = 0.0
        self._rng = random.Random(seed)
        self._started = 0.0
        self._batch_start: float | None = None

    def factor_for(self, rank: int, elapsed: float) -> float:
        profile = self.profiles.get(rank)
        return 1.0 if profile is None else profile.factor_at(elapsed)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._rng = random.Random(self.seed * 1000 + trainer.global_rank)
        self._started = time.perf_counter()
        self._batch_start = None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        start, self._batch_start = self._batch_start, None
        factor = self.factor_for(trainer.global_rank, now - self._started)
        if factor <= 1.0 or start is None:  # no batch start seen (Lightning skips hooks for a None batch)
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
            now = time.perf_counter()
        delay = (factor - 1.0) * (now - start)
        if self.jitter:
            delay *= 1.0 + self._rng.uniform(-self.jitter, self.jitter)
        if delay > 0.0:
            time.sleep(delay)
            self.slept += delay
