"""Simulated time for the pure round machinery: a settable clock, a lap clock on it, and a rank's loader wired to its
round controller as ``FitSession.wrap_dataloader`` wires them."""

from __future__ import annotations

from torch.utils.data import DataLoader

from lightning_oscars import RoundController
from lightning_oscars.core.loader import LoadBalancedLoader


class Time:
    """A rank's simulated clock: call it for the time, set ``now`` to move it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimClock:
    """A lap clock on a rank's simulated time."""

    def __init__(self, time: Time) -> None:
        self.time, self._mark, self._laps = time, 0.0, []

    def mark(self) -> None:
        self._mark = self.time.now

    def lap(self) -> None:
        self._laps.append(self.time.now - self._mark)
        self._mark = self.time.now

    def drain(self) -> list[float]:
        laps, self._laps = self._laps, []
        return laps


def wired_loader(controller: RoundController, data: DataLoader, rank: int, accumulate: int) -> LoadBalancedLoader:
    """Rank ``rank``'s load-balanced loader over ``data`` (2 ranks), deciding its slots with ``controller``'s pacers."""
    loader = LoadBalancedLoader(data, rank, 2, shuffle=True, seed=1, batches_per_slot=accumulate)
    loader.pacer = controller.pacer
    loader.warmup_gate = controller.warmup_gate
    loader.max_slots = controller.epoch_slot_bound(loader.total_units)
    return loader
