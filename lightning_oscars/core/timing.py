"""Step-time measurement and robust statistics.

:class:`StepTimeEstimator` is pure Python. The clocks measure intervals between marks: on the CPU with
``time.perf_counter``; on CUDA with events on the current stream, which are read only when a round ends (a
point where the host waits for the device anyway), so measuring adds no synchronisation per step.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from typing import Protocol

import torch

__all__ = ["CudaEventClock", "LapClock", "StepTimeEstimator", "WallClock", "make_clock"]


class StepTimeEstimator:
    """Seconds per optimizer step of one rank: the median of a round's steps, smoothed across rounds.

    The median ignores the odd slow step (a garbage-collection pause, a checkpoint write); the exponential
    moving average with weight ``smoothing`` on the newest round follows real drift within a few rounds.
    Non-finite or non-positive samples are dropped, counted in :attr:`rejected` and warned about once: a
    broken measurement must neither crash training nor steer the schedule.
    """

    def __init__(self, smoothing: float = 0.5) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must lie in (0, 1], got {smoothing!r}")
        self.smoothing = smoothing
        self.value: float | None = None
        self.rejected = 0
        self._samples: list[float] = []

    def add(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds > 0.0:
            self._samples.append(seconds)
            return
        if not self.rejected:
            warnings.warn(
                f"oscars: ignoring a step time of {seconds!r} s (not a finite positive number); further ones are"
                " only counted",
                RuntimeWarning,
                stacklevel=2,
            )
        self.rejected += 1

    @property
    def pending(self) -> int:
        return len(self._samples)

    def end_round(self) -> float | None:
        """Fold this round's samples into the estimate and return it (``None`` until any sample arrived)."""
        if self._samples:
            median = statistics.median(self._samples)
            self._samples.clear()
            if self.value is None:
                self.value = median
            else:
                self.value = self.smoothing * median + (1.0 - self.smoothing) * self.value
        return self.value


class LapClock(Protocol):
    def mark(self) -> None:
        """Start a new interval now, discarding any open one."""

    def lap(self) -> None:
        """Close the open interval and start the next one."""

    def drain(self) -> list[float]:
        """Seconds of every interval closed since the last drain."""


class WallClock:
    """Host wall-clock laps."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._laps: list[float] = []

    def mark(self) -> None:
        self._last = time.perf_counter()

    def lap(self) -> None:
        now = time.perf_counter()
        self._laps.append(now - self._last)
        self._last = now

    def drain(self) -> list[float]:
        laps, self._laps = self._laps, []
        return laps


class CudaEventClock:
    """Device-timeline laps from CUDA events, resolved lazily in :meth:`drain`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._last = self._record()
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark(self) -> None:
        self._last = self._record()

    def lap(self) -> None:
        now = self._record()
        self._pairs.append((self._last, now))
        self._last = now

    def drain(self) -> list[float]:
        if not self._pairs:
            return []
        self._pairs[-1][1].synchronize()
        laps = [start.elapsed_time(end) / 1000.0 for start, end in self._pairs]
        self._pairs = []
        return laps


def make_clock(device: torch.device) -> LapClock:
    return CudaEventClock(device) if device.type == "cuda" else WallClock()
