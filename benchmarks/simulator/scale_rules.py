"""The parameter server's staleness rules as the paradigms-at-scale study (``scale_paradigms``) runs them: the
answers of ``lightning_oscars.core.staleness``'s rules in O(1) amortised per question instead of O(N) (hours per run
at 1,024 ranks otherwise), and ``Windowed``, which counts a rule's pushes and waits over a steady-state window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_oscars.core.staleness import ASP, DASP, DSSP, SSP, StalenessRule, WorkerTimes

__all__ = ["Windowed"]


def _span(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


class _MinTracker:
    """The minimum of a multiset of integers that enter, leave or grow by one: O(1) amortised per change.

    Why: ``simulate_paradigm`` asks the rule about every waiting worker after every push, and the rules' own
    answers scan all clocks (O(N)): O(N^2) per push, hours per run at 1,024 ranks.
    """

    def __init__(self, values: Sequence[int] = ()) -> None:
        self.count: dict[int, int] = {}
        self.low = min(values, default=0)
        for v in values:
            self.add(v)

    def add(self, v: int) -> None:
        self.count[v] = self.count.get(v, 0) + 1
        self.low = min(self.low, v) if len(self.count) > 1 else v

    def remove(self, v: int) -> None:
        self.count[v] -= 1
        if not self.count[v]:
            del self.count[v]

    def move(self, old: int, new: int) -> None:
        self.remove(old)
        self.add(new)

    def min(self) -> int:
        if self.count:
            while self.low not in self.count:  # the minimum only rises between additions below it
                self.low += 1
        return self.low


class _FastASP(ASP):
    """ASP: nobody waits (the base class builds two O(N) lists to find that out)."""

    def may_start(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> bool:
        return True


class _FastSSP(SSP):
    """SSP answering from a tracked minimum clock. Exact: ``required = clock - s <= clock``, so the slowest of the
    *others* reaches it iff the slowest of all does."""

    def __init__(self, staleness: int = 3) -> None:
        super().__init__(staleness)
        self.slowest: _MinTracker | None = None

    def pushed(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> None:
        super().pushed(worker, clocks, times, now)
        if self.slowest is None:
            self.slowest = _MinTracker([c - (w == worker) for w, c in enumerate(clocks)])
        self.slowest.move(clocks[worker] - 1, clocks[worker])

    def may_start(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> bool:
        low = self.slowest.min() if self.slowest is not None else min(clocks)
        return low >= clocks[worker] - self.staleness


class _FastDSSP(DSSP):
    """DSSP with the laggards found in one pass and refusals remembered. ``DSSP._extra`` evaluates ``min(clocks)``
    once per worker it scans (O(N^2) per grant). A refused worker holds a grant made at the current slowest clock
    (a worker within ``s_low`` always starts), and its threshold stays until that clock moves: while it does not,
    the answer is the same. Same formula and answers otherwise (a test compares the runs)."""

    def __init__(self, s_low: int = 3, s_range: int = 12) -> None:
        super().__init__(s_low, s_range)
        self.slowest: _MinTracker | None = None
        self.refused: dict[int, int] = {}

    def pushed(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> None:
        super().pushed(worker, clocks, times, now)
        if self.slowest is None:
            self.slowest = _MinTracker([c - (w == worker) for w, c in enumerate(clocks)])
        self.slowest.move(clocks[worker] - 1, clocks[worker])
        self.refused.pop(worker, None)

    def may_start(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> bool:
        low = self.slowest.min() if self.slowest is not None else min(clocks)
        if self.refused.get(worker) == low:
            return False
        if low >= self.required_clock(worker, clocks, times, now):  # ``required <= clock``: as for SSP
            return True
        self.refused[worker] = low
        return False

    def _extra(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> int:
        own = times.iteration_s[worker]
        slowest = min(clocks)
        laggards = [w for w, c in enumerate(clocks) if c == slowest]
        if own <= 0.0 or any(times.iteration_s[w] <= 0.0 for w in laggards):
            return 0
        arrival = max(times.last_push[w] + times.iteration_s[w] for w in laggards)
        return min(range(self.s_range + 1), key=lambda r: (abs(now + r * own - arrival), r))


class _FastDASP(DASP):
    """DASP answering from the tracked slowest synchronous round. Exact: a synchronous worker's requirement is its
    own round, so the slowest of the *other* synchronous workers reaches it iff the slowest of all of them does; an
    asynchronous worker waits for nobody. The tracker follows the pusher (the only worker a push can move)."""

    def __init__(self, leave: float = 1.5, rejoin: float = 1.2, patience: int = 2) -> None:
        super().__init__(leave, rejoin, patience)
        self.slowest: _MinTracker | None = None

    def _round(self, worker: int, clocks: Sequence[int]) -> int:
        return clocks[worker] - self._offset.get(worker, 0)

    def pushed(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> None:
        if self.slowest is None:
            self.slowest = _MinTracker([c - (w == worker) for w, c in enumerate(clocks)])
        was_sync = worker not in self.asynchronous
        before = self._round(worker, clocks) - 1
        super().pushed(worker, clocks, times, now)
        is_sync = worker not in self.asynchronous
        if was_sync:
            self.slowest.remove(before)
        if is_sync:
            self.slowest.add(self._round(worker, clocks))

    def may_start(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> bool:
        if worker in self.asynchronous:
            return True
        low = self.slowest.min() if self.slowest is not None else min(clocks)
        return low >= self._round(worker, clocks)


class Windowed(StalenessRule):
    """A staleness rule as ``simulate_paradigm`` runs it, counted over a steady-state window ``[start_s, end_s]``:
    pushes, waits, and the index of the window's first update (for its staleness).

    The throughput is read between the first and the last time the slowest clock moves inside the window: under
    SSP and DSSP every worker's clock is tied to the slowest one's, so a window cut mid-cycle would count a
    fraction of a cycle's burst of pushes as a whole one (+-1 slow iteration per window otherwise).
    """

    def __init__(self, rule: StalenessRule, start_s: float, end_s: float) -> None:
        self.rule, self.name = rule, rule.name
        self.start_s, self.end_s = start_s, end_s
        self.pushes = self.before = 0
        self.since: dict[int, float] = {}
        self.waited_s = 0.0
        self.slowest: _MinTracker | None = None
        self.cycles: list[tuple[float, int]] = []  # (time, pushes so far) when the slowest clock moved

    def __getattr__(self, name: str) -> Any:  # the rule's traces (DASP's ``switches``)
        return getattr(self.rule, name)

    def may_start(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> bool:
        if not self.rule.may_start(worker, clocks, times, now):
            return False
        self.waited_s += _span(self.since.pop(worker, now), now, self.start_s, self.end_s)
        return True

    def pushed(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> None:
        self.rule.pushed(worker, clocks, times, now)
        if now < self.start_s:
            self.before += 1
        else:
            self.pushes += 1
        self.since[worker] = now
        if self.slowest is None:
            self.slowest = _MinTracker([c - (w == worker) for w, c in enumerate(clocks)])
        low = self.slowest.min()
        self.slowest.move(clocks[worker] - 1, clocks[worker])
        if self.slowest.min() != low and now >= self.start_s:
            self.cycles.append((now, self.pushes))

    def throughput(self) -> float:
        """Pushes per second between the window's first and last moves of the slowest clock (the whole window when
        it moved fewer than twice)."""
        if len(self.cycles) >= 2 and self.cycles[-1][0] > self.cycles[0][0]:
            (t0, p0), (t1, p1) = self.cycles[0], self.cycles[-1]
            return (p1 - p0) / (t1 - t0)
        return self.pushes / (self.end_s - self.start_s)

    def idle(self, n: int) -> float:
        """Mean share of the window spent waiting, the waits still open at its end included."""
        open_s = sum(_span(s, self.end_s, self.start_s, self.end_s) for s in self.since.values())
        return (self.waited_s + open_s) / (n * (self.end_s - self.start_s))
