"""Discrete-event simulation of a parameter server under the staleness rules of ``lightning_oscars.core.staleness``.

Every worker loops: pull the parameters, compute for its step time, push its update; before starting the next
iteration it asks the rule, and waits until the rule lets it start. The server applies every push at once (its
own cost and the transfers are ``push_s`` per iteration, added to the worker's step). What comes out is what
the paradigm benchmark reports per worker (iterations, busy and waiting time) and per update (its staleness:
updates the server applied between the worker's pull and its push; its lead: the worker's clock minus the
slowest's when it started), plus the rules' own traces (DSSP's thresholds, DASP's switches).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lightning_oscars.core.staleness import DSSP, StalenessRule, WorkerTimes

__all__ = ["ParadigmRun", "simulate_paradigm"]

StepTime = Callable[[int, int, float], float]  # (worker, iteration, now) -> seconds


@dataclass
class ParadigmRun:
    """One simulated run: per worker and per update."""

    rule: str
    duration_s: float
    iterations: list[int]
    busy_s: list[float]
    waited_s: list[float]
    staleness: list[int] = field(default_factory=list)  # per update, in the order the server applied them
    lead: list[tuple[int, int]] = field(default_factory=list)  # (worker, clock lead over the slowest) per start
    thresholds: list[tuple[float, int, int]] = field(default_factory=list)  # DSSP: (time, worker, threshold)
    switches: list[tuple[float, int, str]] = field(default_factory=list)  # DASP: (time, worker, new state)

    @property
    def updates_per_s(self) -> float:
        return sum(self.iterations) / self.duration_s if self.duration_s > 0 else 0.0


def simulate_paradigm(
    rule: StalenessRule,
    step_s: Sequence[float] | StepTime,
    duration_s: float,
    push_s: float = 0.0,
    world_size: int | None = None,
) -> ParadigmRun:
    """Run ``rule`` for ``duration_s`` simulated seconds. ``step_s``: every worker's seconds per iteration, or a
    function ``(worker, iteration, now) -> seconds`` (slowdowns, jitter)."""
    n, step = _step_time(step_s, world_size)
    times = WorkerTimes(n)
    clocks = [0] * n
    version = 0
    pulled = [0] * n
    started = [0.0] * n
    waiting_since: dict[int, float] = {}
    run = ParadigmRun(rule.name, duration_s, [0] * n, [0.0] * n, [0.0] * n)
    events: list[tuple[float, int]] = []

    def start(worker: int, now: float) -> None:
        nonlocal version
        pulled[worker] = version
        started[worker] = now
        run.lead.append((worker, clocks[worker] - min(clocks)))
        if isinstance(rule, DSSP):
            run.thresholds.append((now, worker, rule.threshold(worker)))
        heapq.heappush(events, (now + step(worker, clocks[worker], now) + push_s, worker))

    for worker in range(n):
        start(worker, 0.0)
    while events:
        now, worker = heapq.heappop(events)
        if now > duration_s:
            break
        busy = now - started[worker]
        run.busy_s[worker] += busy
        run.iterations[worker] += 1
        run.staleness.append(version - pulled[worker])
        version += 1
        clocks[worker] += 1
        times.pushed(worker, now, busy)
        rule.pushed(worker, clocks, times, now)
        waiting_since[worker] = now
        progressed = True
        while progressed:  # one start can let others start (DASP moves, BSP's last arrival)
            progressed = False
            for w in sorted(waiting_since):
                if rule.may_start(w, clocks, times, now):
                    run.waited_s[w] += now - waiting_since.pop(w)
                    start(w, now)
                    progressed = True
        if not events:
            raise RuntimeError(f"{rule.name}: every worker waits for another (deadlock) at {now:.3f} s")
    _close(run, rule, waiting_since)
    return run


def _step_time(step_s: Sequence[float] | StepTime, world_size: int | None) -> tuple[int, StepTime]:
    """The number of workers and the step-time function, from either form ``simulate_paradigm`` takes."""
    if callable(step_s):
        if world_size is None:
            raise ValueError("world_size is needed with a step-time function")
        return world_size, step_s
    times_s = list(step_s)
    return len(times_s), lambda worker, iteration, now: times_s[worker]


def _close(run: ParadigmRun, rule: StalenessRule, waiting_since: dict[int, float]) -> None:
    """At the end of the run: the waits still open count up to its end; the rule's own trace (DASP's switches)."""
    for w, since in waiting_since.items():
        run.waited_s[w] += max(0.0, run.duration_s - since)
    if hasattr(rule, "switches"):
        run.switches = list(rule.switches)
