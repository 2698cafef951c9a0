"""Discrete-event model of Ripples' decentralized training: partial all-reduces among groups of workers.

The groups come from :class:`lightning_oscars.core.groups.GroupBoard` itself (the generator is not modelled again
here); this module only drives it in simulated time, with the protocol of the board's docstring (and of the
``drive`` helper of ``tests/test_groups.py``):

* a worker ends a step, calls ``board.request(worker, consumed, now)`` (``consumed``: groups it performed so
  far), appends the placements to the members' FIFO buffers, then waits at its buffer's head group;
* a group is performed when every member waits at it as its head: the exchange (one partial all-reduce among
  the members) takes ``exchange_s(len(group))`` seconds, then every member starts its next step. A group of one
  (a worker alone) costs nothing.
* with ``iterations``, a worker that has taken its last step leaves the round (``board.end_round``), performs the
  groups still in its buffer and waits for the others (the round's global all-reduce would follow; it is not
  modelled).

Cost: every step end and every group is O(1) heap / deque work (a group's arrivals are counted, not rescanned),
so the model is O(events log n) plus what ``GroupBoard.request`` itself costs (a linear scan of the workers when
it makes a division or a smart group).

Accounting: a worker's time is split into busy (its steps), exchange (its groups' partial all-reduces) and
waiting (at a group's head until the last member arrives, and after its last step in ``iterations`` mode). With
``warmup_s`` everything is counted only from that time on, so start-up transients (the smart generator has no
pace estimates yet) do not bias the steady-state figures.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from lightning_oscars.core.groups import Generator, Group, GroupBoard

__all__ = ["RipplesRun", "log_scaled_exchange", "register_all", "simulate_ripples"]

StepTime = Callable[[int, int, float], float]  # (worker, iteration, now) -> seconds, as in ``paradigms``
ExchangeTime = Callable[[int], float]  # group size -> seconds of one partial all-reduce among that many


@dataclass
class RipplesRun:
    """One simulated run, counted over ``[start_s, end_s]``. Per-worker lists are indexed by rank."""

    generator: str
    start_s: float
    end_s: float
    iterations: list[int]
    busy_s: list[float]
    exchange_s: list[float]
    waited_s: list[float]
    groups: list[int]  # groups of two or more performed
    slow_groups: list[int]  # of those, the ones that included a worker of ``slow`` other than this one
    made: list[Group] = field(default_factory=list)  # every group of two or more the board made (its history)

    @property
    def window_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def updates_per_s(self) -> float:
        """Steps per second summed over workers (samples/s divided by the batch size)."""
        return sum(self.iterations) / self.window_s if self.window_s > 0 else 0.0

    @property
    def idle_fraction(self) -> float:
        """Mean share of the window the workers spent waiting (exchanges are not idle: they move data)."""
        return sum(self.waited_s) / (len(self.waited_s) * self.window_s) if self.window_s > 0 else 0.0


def log_scaled_exchange(allreduce_s: float, world_size: int) -> ExchangeTime:
    """A partial all-reduce among ``k`` workers costs ``allreduce_s * ln k / ln world_size``.

    Why: a latency-bound (tree / recursive-doubling) all-reduce takes ``log2`` of its members' count in rounds,
    so a group pays that share of the full all-reduce. A bandwidth-bound ring would charge more (``(k-1)/k`` of
    the full one's ``(N-1)/N``), so this is the optimistic model for Ripples.
    """
    if world_size < 2:
        return lambda k: 0.0
    scale = allreduce_s / math.log(world_size)
    return lambda k: scale * math.log(k) if k >= 2 else 0.0


def _span(a: float, b: float, lo: float, hi: float) -> float:
    """Length of ``[a, b]`` inside ``[lo, hi]``."""
    return max(0.0, min(b, hi) - max(a, lo))


def simulate_ripples(
    step_s: Sequence[float] | StepTime,
    world_size: int | None = None,
    *,
    iterations: int | None = None,
    duration_s: float | None = None,
    group_size: int = 4,
    generator: Generator = "smart",
    exchange_s: float | ExchangeTime = 0.0,
    buffer_size: int = 2,
    tolerance: float = 0.1,
    seed: int = 0,
    warmup_s: float = 0.0,
    slow: Collection[int] = (),
    warm_start: bool = False,
    paces: Sequence[float] | None = None,
) -> RipplesRun:
    """Run Ripples for ``iterations`` steps per worker or for ``duration_s`` simulated seconds (one of them).

    ``step_s``: every worker's seconds per step, or ``(worker, iteration, now) -> seconds`` (jitter, slowdowns).
    ``exchange_s``: seconds of one partial all-reduce, a constant or a function of the group's size (e.g.
    :func:`log_scaled_exchange`). ``group_size``, ``generator``, ``buffer_size``, ``tolerance``, ``seed``: the
    :class:`GroupBoard`'s. ``slow``: ranks whose presence in a group is counted in ``RipplesRun.slow_groups``.
    ``warm_start`` / ``paces``: start on a warm board (:func:`register_all`) instead of a cold one.
    """
    if (iterations is None) == (duration_s is None):
        raise ValueError("give exactly one of iterations and duration_s")
    if iterations is not None and iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    if paces is not None and not warm_start:
        raise ValueError("paces are known only to a warm board: pass warm_start=True")
    if duration_s is not None and not duration_s > warmup_s >= 0:
        raise ValueError(f"need duration_s > warmup_s >= 0, got {duration_s} and {warmup_s}")
    step, n = _step_function(step_s, world_size)
    cost = exchange_s if callable(exchange_s) else (lambda k, c=float(exchange_s): c if k >= 2 else 0.0)
    board = GroupBoard(n, group_size, generator, buffer_size, tolerance, seed)
    if warm_start:
        register_all(board, paces)
    return _Sim(board, step, cost, iterations, duration_s, warmup_s, frozenset(slow)).run()


def register_all(board: GroupBoard, paces: Sequence[float] | None = None) -> None:
    """A warm board: with ``paces``, the ``smart`` generator knows every worker's seconds per iteration (as after a
    profiling warm-up) and expects its first step end at that time. (Every worker takes part from the start.)"""
    if paces is not None:
        board.know_paces(paces, now=0.0)


def _step_function(step_s: Sequence[float] | StepTime, world_size: int | None) -> tuple[StepTime, int]:
    if callable(step_s):
        if world_size is None:
            raise ValueError("world_size is needed with a step-time function")
        return step_s, world_size
    times = [float(t) for t in step_s]
    if world_size is not None and world_size != len(times):
        raise ValueError(f"world_size {world_size} does not match {len(times)} step times")
    return (lambda worker, iteration, now: times[worker]), len(times)


class _Sim:
    """State of one run. Group *instances* are numbered: the same ranks may form a group many times."""

    def __init__(
        self,
        board: GroupBoard,
        step: StepTime,
        cost: ExchangeTime,
        iterations: int | None,
        duration_s: float | None,
        warmup_s: float,
        slow: frozenset[int],
    ) -> None:
        n = board.world_size
        self.board, self.step, self.cost, self.slow = board, step, cost, slow
        self.iterations, self.warmup_s = iterations, warmup_s
        self.end = math.inf if duration_s is None else duration_s
        self.buffers: list[deque[int]] = [deque() for _ in range(n)]
        self.members: list[Group] = []  # per instance
        self.arrived: list[int] = []  # per instance: members waiting at it as their head
        self.consumed, self.steps = [0] * n, [0] * n
        self.started = [0.0] * n  # the current step's start
        self.since: dict[int, float] = {}  # waiting workers -> since when
        self.leaving: set[int] = set()
        self.finished: dict[int, float] = {}  # workers done with their round -> when
        self.events: list[tuple[float, int]] = []
        zeros, seconds = (lambda: [0] * n), (lambda: [0.0] * n)
        self.out = RipplesRun(
            board.generator, warmup_s, 0.0, zeros(), seconds(), seconds(), seconds(), zeros(), zeros()
        )

    def run(self) -> RipplesRun:
        for i in range(len(self.steps)):
            self._start(i, 0.0)
        last = 0.0
        while self.events:
            now, i = heapq.heappop(self.events)
            if now > self.end:
                heapq.heappush(self.events, (now, i))
                break
            last = now
            self._end_step(i, now)
        if self.since and self.end == math.inf:
            raise RuntimeError(f"deadlock: workers {sorted(self.since)} wait and no event is left")
        return self._close(last)

    def _start(self, i: int, now: float) -> None:
        self.started[i] = now
        heapq.heappush(self.events, (now + self.step(i, self.steps[i], now), i))

    def _end_step(self, i: int, now: float) -> None:
        self.steps[i] += 1
        if now >= self.warmup_s:
            self.out.iterations[i] += 1
        self.out.busy_s[i] += _span(self.started[i], now, self.warmup_s, self.end)
        if self.iterations is not None and self.steps[i] >= self.iterations:
            self.leaving.add(i)
            self.board.end_round(i)
        else:
            self._place(self.board.request(i, self.consumed[i], now))
        self._arrive([(i, now)])

    def _place(self, placements: list[tuple[int, int, Group]]) -> None:
        """Append the board's placements to the buffers: consecutive placements of one group are one instance."""
        instance, left = -1, 0
        for member, index, group in placements:
            if left == 0:
                instance, left = len(self.members), len(group)
                self.members.append(group)
                self.arrived.append(0)
            if index != self.consumed[member] + len(self.buffers[member]):
                raise RuntimeError(f"buffer index {index} of worker {member} is not its buffer's end")
            self.buffers[member].append(instance)
            left -= 1

    def _arrive(self, arrivals: list[tuple[int, float]]) -> None:
        """Workers reach their buffers' heads; perform every group whose last member this is (a worker draining
        its buffer after its last step arrives at its next group at once: a work list, not recursion)."""
        while arrivals:
            i, now = arrivals.pop()
            if not self.buffers[i]:
                if i not in self.leaving:
                    raise RuntimeError(f"worker {i} stepped and has no group: the board placed none")
                self.finished[i] = now
                continue
            self.since[i] = now
            head = self.buffers[i][0]
            self.arrived[head] += 1
            if self.arrived[head] == len(self.members[head]):
                arrivals.extend(self._perform(head, now))

    def _perform(self, instance: int, now: float) -> list[tuple[int, float]]:
        group = self.members[instance]
        done = now + (self.cost(len(group)) if len(group) > 1 else 0.0)
        counted = self.warmup_s <= now <= self.end
        has_slow = [m for m in group if m in self.slow]
        drained = []
        for m in group:
            self.out.waited_s[m] += _span(self.since.pop(m), now, self.warmup_s, self.end)
            self.out.exchange_s[m] += _span(now, done, self.warmup_s, self.end)
            self.buffers[m].popleft()
            self.consumed[m] += 1
            if counted and len(group) > 1:
                self.out.groups[m] += 1
                self.out.slow_groups[m] += any(s != m for s in has_slow)
            if m in self.leaving:
                drained.append((m, done))
            else:
                self._start(m, done)
        return drained

    def _close(self, last: float) -> RipplesRun:
        """Close the window: at ``duration_s``, or at the last event (everybody waits for the last one)."""
        end = self.end if self.end != math.inf else max([last, *self.finished.values()])
        out = self.out
        out.end_s = end
        for i, since in self.since.items():
            out.waited_s[i] += _span(since, end, self.warmup_s, end)
        for i, at in self.finished.items():
            out.waited_s[i] += _span(at, end, self.warmup_s, end)
        if self.end != math.inf:  # steps still running at the end: their share of the window is busy
            for _, i in self.events:
                out.busy_s[i] += _span(self.started[i], end, self.warmup_s, end)
        out.made = list(self.board.history)
        return out
