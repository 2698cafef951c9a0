"""When may a worker start its next iteration? The staleness rules of the parameter-server paradigms.

A parameter server keeps one *clock* per worker: the number of updates (iterations) the worker has pushed. When
worker ``i`` has pushed and asks to start its next iteration, a rule answers with the clock the *slowest* worker
must have reached first (:meth:`StalenessRule.required_clock`); the worker waits until ``min(clocks)`` reaches it.
A worker at clock ``c`` that starts while the slowest is at ``m`` computes on parameters that miss at most
``c - m`` of the slowest's updates: its *staleness*.

* :class:`BSP`: everybody meets after every iteration (``m >= c``): no staleness, everybody waits for the slowest.
* :class:`ASP` (asynchronous parallel): nobody ever waits; staleness unbounded.
* :class:`SSP` (stale synchronous parallel, Ho et al. 2013): start while ``c - m <= s``.
* :class:`DSSP` (dynamic SSP, Zhao et al. 2019, seed 003): the threshold moves per iteration within
  ``[s_low, s_low + s_range]``, from the workers' recent iteration times. Our rule (the seed gives the idea, not
  the formula): while ``c - m <= s_low`` the worker starts. At the bound, the server predicts, from each worker's
  recent iteration time and last push, when the slowest worker will push next, and grants the fast worker the
  number of further iterations ``r`` in ``0..s_range`` whose predicted end lies closest to that moment: it then
  meets the slowest's update instead of waiting a whole iteration of the slowest or running far ahead. The grant
  holds until the slowest worker pushes again.
* :class:`DASP` (dynamic adaptive synchronous parallel, seed 002): the server keeps every worker's state,
  *synchronous* or *asynchronous*, and moves workers between them by speed. Our rule: every worker's iteration
  time is smoothed (EMA); the reference is the median of the synchronous workers' times. A synchronous worker
  whose time exceeds ``leave`` x the reference for ``patience`` consecutive pushes becomes asynchronous; an
  asynchronous worker whose time falls below ``rejoin`` x the reference for ``patience`` pushes becomes
  synchronous again (hysteresis: ``rejoin < leave``). Synchronous workers meet each other after every
  iteration (BSP among them: their updates are never stale relative to each other); an asynchronous worker never
  waits and the synchronous ones never wait for it. A worker that rejoins counts its iterations from the
  synchronous group's furthest one (it pulls fresh parameters), so nobody waits for it to catch up on clocks.
  So a slow worker stops holding the fast group back, and the fast group does not pile stale updates on the
  server the way ASP does. Every shard of the server must agree on a worker's state and offset (shards that
  disagree can hold two workers for each other for ever), so the worker's own shard decides them
  (:meth:`StalenessRule.decision`) and the others adopt what the worker's pushes carry.

Pure: no torch, no torch.distributed; time is passed in.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence, Set
from dataclasses import dataclass, field

__all__ = ["ASP", "BSP", "DASP", "DSSP", "NOBODY", "SSP", "StalenessRule", "WorkerTimes"]


def _count(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


@dataclass
class WorkerTimes:
    """What the server knows of every worker's timing: its last push and its smoothed iteration time."""

    world_size: int
    smoothing: float = 0.5
    last_push: list[float] = field(default_factory=list)
    iteration_s: list[float] = field(default_factory=list)  # 0.0 while unknown

    def __post_init__(self) -> None:
        _count("world_size", self.world_size, 1)
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must lie in (0, 1], got {self.smoothing!r}")
        self.last_push = self.last_push or [0.0] * self.world_size
        self.iteration_s = self.iteration_s or [0.0] * self.world_size

    def pushed(self, worker: int, now: float, busy_s: float) -> None:
        """``worker`` pushed at ``now`` after computing ``busy_s`` seconds (its wait excluded)."""
        old = self.iteration_s[worker]
        self.iteration_s[worker] = busy_s if old <= 0.0 else old + self.smoothing * (busy_s - old)
        self.last_push[worker] = now


NOBODY: frozenset[int] = frozenset()
"""No worker is exempt: every clock counts."""


class StalenessRule:
    """Decides when a worker may start its next iteration (see the module docstring).

    ``exempt``, wherever a method takes it: the workers that hold nobody back right now (a stopped worker, or one
    that ended the asking worker's round on an in-job server). Their entries in ``clocks`` are stale and are never
    compared, nor taken into a rule's state.
    """

    name = "rule"
    # Every worker takes exactly one step per clock (BSP): a round ends at the same clock for everybody, so once one
    # worker takes no further step in a round, nobody does (``Shard``'s round closing).
    lockstep = False
    # The most iterations a worker may lead any other by (``None``: unbounded): a round's schedule gives no rank more
    # steps than the fewest plus this bound and one, which it could not take without waiting for a peer that ended
    # the round.
    max_lead: int | None = None

    def required_clock(
        self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float, exempt: Set[int] = NOBODY
    ) -> int | None:
        """The clock every worker this one waits for must have reached before ``worker`` starts its next
        iteration; ``None``: start now, wait for nobody."""
        raise NotImplementedError

    def waits_for(self, worker: int, clocks: Sequence[int]) -> list[int]:
        """The workers whose clocks :meth:`required_clock` is compared with (default: all others)."""
        return [w for w in range(len(clocks)) if w != worker]

    def rounds(self, clocks: Sequence[int]) -> list[int]:
        """The clocks the rule compares (default: the clocks themselves)."""
        return list(clocks)

    def may_start(
        self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float, exempt: Set[int] = NOBODY
    ) -> bool:
        others = [w for w in self.waits_for(worker, clocks) if w not in exempt]
        if not others:
            return True
        rounds = self.rounds(clocks)
        required = self.required_clock(worker, rounds, times, now, exempt)
        return required is None or min(rounds[w] for w in others) >= required

    def would_start(
        self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float, exempt: Set[int] = NOBODY
    ) -> bool:
        """:meth:`may_start` as a question only: the rule's state is left as it was (a shard asks what an answer
        would be under another view of the clocks)."""
        return self.may_start(worker, clocks, times, now, exempt)

    def pushed(
        self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float, exempt: Set[int] = NOBODY
    ) -> None:
        """``worker`` just pushed (its clock and ``times`` are already updated): adjust state."""

    def restart(self, worker: int) -> None:  # noqa: B027 - optional: most rules keep no per-clock state
        """``worker``'s clock restarts from 0 (everybody met at a round's end): forget state tied to its clocks."""

    # A rule whose per-worker state must be the same on every shard (a shard's view of the other workers lags by
    # up to a message) has it decided by one shard only, the worker's own, and carried with the worker's pushes.
    decision_size = 0  # numbers in :meth:`decision`

    def decision(self, worker: int) -> tuple[float, ...]:
        """``worker``'s state as its own shard decided it at its last push, to be :meth:`adopt`-ed elsewhere."""
        return ()

    def adopt(self, worker: int, decision: Sequence[float], now: float) -> None:  # noqa: B027 - optional
        """Take ``worker``'s state from its own shard's :meth:`decision`, in place of :meth:`pushed`."""


class BSP(StalenessRule):
    name = "bsp"
    lockstep = True
    max_lead = 0

    def required_clock(
        self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float, exempt: Set[int] = NOBODY
    ) -> int | None:
        return clocks[worker]


class ASP(StalenessRule):
    name = "asp"

    def required_clock(
        self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float, exempt: Set[int] = NOBODY
    ) -> int | None:
        return None


class SSP(StalenessRule):
    """Start while this worker is at most ``staleness`` clocks ahead of the slowest."""

    name = "ssp"

    def __init__(self, staleness: int = 3) -> None:
        self.staleness = _count("staleness", staleness, 0)
        self.max_lead = self.staleness

    def required_clock(
        self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float, exempt: Set[int] = NOBODY
    ) -> int | None:
        return clocks[worker] - self.staleness


class DSSP(StalenessRule):
    """SSP whose threshold moves per iteration within ``[s_low, s_low + s_range]`` (see the module docstring)."""

    name = "dssp"

    def __init__(self, s_low: int = 3, s_range: int = 12) -> None:
        self.s_low = _count("s_low", s_low, 0)
        self.s_range = _count("s_range", s_range, 0)
        self.max_lead = self.s_low + self.s_range
        self.granted: dict[int, int] = {}  # worker -> the slowest clock its grant was given at, and its threshold
        self._threshold: dict[int, int] = {}

    def threshold(self, worker: int) -> int:
        """The threshold currently in force for ``worker``."""
        return self._threshold.get(worker, self.s_low)

    def required_clock(
        self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float, exempt: Set[int] = NOBODY
    ) -> int | None:
        # An exempt worker is never the slowest: above every clock (the asking worker's included), it is nobody's
        # laggard either.
        above = max(clocks) + 1
        counted = [above if w in exempt and w != worker else c for w, c in enumerate(clocks)]
        slowest = min(counted)
        if self.granted.get(worker) != slowest:  # no grant yet at this slowest clock: back to the lower bound
            self._threshold[worker] = self.s_low
            if clocks[worker] - slowest > self.s_low:
                self._threshold[worker] = self.s_low + self._extra(worker, counted, times, now)
                self.granted[worker] = slowest
        return clocks[worker] - self.threshold(worker)

    def restart(self, worker: int) -> None:
        self.granted.pop(worker, None)
        self._threshold.pop(worker, None)

    def would_start(
        self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float, exempt: Set[int] = NOBODY
    ) -> bool:
        # The grant at the slowest clock is state: asked under another view it would be reset and re-drawn.
        granted, threshold = dict(self.granted), dict(self._threshold)
        try:
            return self.may_start(worker, clocks, times, now, exempt)
        finally:
            self.granted, self._threshold = granted, threshold

    def _extra(self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float) -> int:
        """Further iterations ``r`` in ``0..s_range`` whose predicted end is closest to the slowest's next push."""
        own = times.iteration_s[worker]
        slowest = min(clocks)
        laggards = [w for w, clock in enumerate(clocks) if clock == slowest]
        if own <= 0.0 or any(times.iteration_s[w] <= 0.0 for w in laggards):
            return 0  # nothing measured yet: plain SSP at s_low
        arrival = max(times.last_push[w] + times.iteration_s[w] for w in laggards)
        return min(range(self.s_range + 1), key=lambda r: (abs(now + r * own - arrival), r))


class DASP(StalenessRule):
    """Synchronous and asynchronous workers, moved between the states by speed (see the module docstring)."""

    name = "dasp"

    def __init__(self, leave: float = 1.5, rejoin: float = 1.2, patience: int = 2) -> None:
        if not 1.0 <= rejoin < leave:
            raise ValueError(f"need 1 <= rejoin < leave, got rejoin={rejoin!r}, leave={leave!r}")
        self.leave = float(leave)
        self.rejoin = float(rejoin)
        self.patience = _count("patience", patience, 1)
        self.asynchronous: set[int] = set()
        self._strikes: dict[int, int] = {}
        self._offset: dict[int, int] = {}  # worker -> clocks it ran while asynchronous, not counted among the sync
        self.switches: list[tuple[float, int, str]] = []  # (time, worker, new state)

    decision_size = 2  # asynchronous (1.0) or not, and the offset

    def restart(self, worker: int) -> None:
        self._offset.pop(worker, None)

    def decision(self, worker: int) -> tuple[float, ...]:
        return float(worker in self.asynchronous), float(self._offset.get(worker, 0))

    def adopt(self, worker: int, decision: Sequence[float], now: float) -> None:
        asynchronous, offset = bool(decision[0]), int(decision[1])
        if asynchronous != (worker in self.asynchronous):
            self.asynchronous.symmetric_difference_update({worker})
            self.switches.append((now, worker, self.state(worker)))
        if offset:
            self._offset[worker] = offset
        else:
            self._offset.pop(worker, None)

    def state(self, worker: int) -> str:
        return "async" if worker in self.asynchronous else "sync"

    def waits_for(self, worker: int, clocks: Sequence[int]) -> list[int]:
        if worker in self.asynchronous:
            return []
        return [w for w in range(len(clocks)) if w != worker and w not in self.asynchronous]

    def rounds(self, clocks: Sequence[int]) -> list[int]:
        return [c - self._offset.get(w, 0) for w, c in enumerate(clocks)]

    def required_clock(
        self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float, exempt: Set[int] = NOBODY
    ) -> int | None:
        return None if worker in self.asynchronous else clocks[worker]

    def reference_s(self, times: WorkerTimes) -> float:
        """The median smoothed iteration time of the synchronous workers (all workers if none is)."""
        known = [t for w, t in enumerate(times.iteration_s) if t > 0.0 and w not in self.asynchronous]
        known = known or [t for t in times.iteration_s if t > 0.0]
        return statistics.median(known) if known else 0.0

    def pushed(
        self, worker: int, clocks: Sequence[int], times: WorkerTimes, now: float, exempt: Set[int] = NOBODY
    ) -> None:
        reference, own = self.reference_s(times), times.iteration_s[worker]
        if reference <= 0.0 or own <= 0.0:
            return
        if worker in self.asynchronous:
            strike = own < self.rejoin * reference
        else:
            strike = own > self.leave * reference and len(clocks) - len(self.asynchronous) > 1
        self._strikes[worker] = self._strikes.get(worker, 0) + 1 if strike else 0
        if self._strikes[worker] >= self.patience:
            self._strikes[worker] = 0
            self.asynchronous.symmetric_difference_update({worker})
            if worker not in self.asynchronous:
                # Counted from the furthest synchronous peer that still holds anybody back: a stopped worker's or one
                # past the round's end has a clock that no longer moves (or one of the next round), and counting
                # from it would make the rejoining worker wait for iterations nobody will run.
                rounds = self.rounds(clocks)
                peers = [rounds[w] for w in self.waits_for(worker, clocks) if w not in exempt]
                self._offset[worker] = clocks[worker] - max(peers, default=clocks[worker])
            self.switches.append((now, worker, self.state(worker)))
