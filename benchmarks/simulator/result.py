"""What one simulated run did (:class:`SimResult`), as ``engine.simulate`` returns it and the studies report it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["SimResult"]


@dataclass
class SimResult:
    """What one simulated run did. Times in seconds; arrays are per rank. ``rounds`` counts averagings.

    ``validation_s``: simulated train time at every validation; ``history``: per-averaging records (if asked);
    ``epoch_slots``: every epoch's slots as sized at its start (an upper bound while the speeds are unknown).
    """

    paradigm: str
    wall_s: float
    units: int
    rounds: int
    compute_s: np.ndarray
    idle_s: np.ndarray
    comm_s: float
    other_s: float
    round_utilization: float
    schedule_changes: list[tuple[int, tuple[int, ...]]]
    epoch_end_s: list[float]
    validation_s: list[float] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    epoch_slots: list[int] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Optimizer steps per second summed over ranks (samples/s divided by the batch size)."""
        return self.units / self.wall_s

    @property
    def utilization(self) -> float:
        """Compute time over the cluster's time: ``sum_i compute_i / (N x wall)``."""
        return float(self.compute_s.sum() / (len(self.compute_s) * self.wall_s))

    @property
    def idle_fraction(self) -> np.ndarray:
        """Per rank: share of the wall time spent waiting at barriers or in no-op slots."""
        return self.idle_s / self.wall_s

    @property
    def final_local_steps(self) -> tuple[int, ...] | None:
        return self.schedule_changes[-1][1] if self.schedule_changes else None

    def summary(self, ideal: float | None = None, classes: Sequence[str] | None = None) -> dict[str, Any]:
        """JSON-ready figures; per-rank arrays are reduced to mean/min/max (and per-class means if given)."""
        idle = self.idle_fraction
        out: dict[str, Any] = {
            "paradigm": self.paradigm,
            "wall_s": self.wall_s,
            "steps": self.units,
            "rounds": self.rounds,
            "throughput": self.throughput,
            "utilization": self.utilization,
            "round_utilization": self.round_utilization,
            "comm_fraction": self.comm_s / self.wall_s,
            "idle_mean": float(idle.mean()),
            "idle_min": float(idle.min()),
            "idle_max": float(idle.max()),
            "final_local_steps": _compress_steps(self.final_local_steps, classes),
            "schedule_changes": len(self.schedule_changes),
        }
        if ideal:
            out["fraction_of_ideal"] = self.throughput / ideal
        if classes is not None:
            labels = np.asarray(classes)
            out["idle_by_class"] = {str(c): float(idle[labels == c].mean()) for c in dict.fromkeys(classes)}
        return out


def _compress_steps(steps: tuple[int, ...] | None, classes: Sequence[str] | None) -> Any:
    """Local steps per speed class (``{"1x": [16], ...}``) for large clusters, the plain tuple for small ones."""
    if steps is None:
        return None
    if classes is None or len(steps) <= 8:
        return list(steps)
    out: dict[str, list[int]] = {}
    for c, tau in zip(classes, steps):
        out.setdefault(str(c), [])
        if tau not in out[str(c)]:
            out[str(c)].append(tau)
    return {c: sorted(v) for c, v in out.items()}
