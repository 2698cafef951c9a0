"""The ledger of one fit's rounds: what every rank agreed on at each averaging, and what it asks of the next.

:class:`RoundLedger` keeps the round's fixed cost (the median of recent rounds' measured costs, which the solver
prices), every rank's smoothed step jitter (deadline rounds size from it), the requests that travel in the next
round's control data (stop, SIGTERM, requeue), the history of :class:`~lightning_oscars.core.control.RoundRecord`
and the fit's clock of training time (validation and checkpoint writes left out). It decides nothing about slots:
that is the round controller's (``rounds.py``). No Lightning, no torch.distributed.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_oscars.core.control import ControlData, RoundRecord

__all__ = ["COST_WINDOW", "JITTER_SMOOTHING", "MEDIAN_ERROR", "RoundLedger", "RoundOutcome", "step_jitter"]

# Weight of the newest round in the moving average of every rank's step jitter (deadline rounds).
JITTER_SMOOTHING = 0.3
# A MAD of log step times, divided by this, estimates the log-spread (sigma) of lognormal steps.
_MAD_TO_SIGMA = 0.6745
# Rounds whose measured fixed cost the solver's price is the median of: epoch ends, checkpoint writes and the
# first round after validation cost more than a plain round, and must not re-solve the schedule each time.
COST_WINDOW = 9
# A sample median's standard error over the spread's sigma, times sqrt(n) (sqrt(pi / 2) for normal noise).
MEDIAN_ERROR = math.sqrt(math.pi / 2)


def step_jitter(seconds: list[float], reference: float) -> float:
    """The log-spread of a round's step times around the rank's long-run median ``reference`` (a MAD: a round holds
    too few steps for quartiles); 0 with fewer than two steps."""
    logs = [abs(math.log(s / reference)) for s in seconds if s > 0.0 and reference > 0.0]
    return statistics.median(logs) / _MAD_TO_SIGMA if len(logs) >= 2 else 0.0


@dataclass(frozen=True)
class RoundOutcome:
    """What an averaging decided, the same on every rank.

    Attributes:
        record: the round as every rank agreed on it.
        stop: some rank asked to stop (``should_stop``, an expired ``Timer``).
        sigterm: some rank received SIGTERM: every rank shuts down at this batch.
        requeue: some rank received the requeue signal: every rank runs the requeue handler now.
        rebalanced: a new schedule was adopted.
        resized: the epoch got shorter (the first schedule cut an epoch sized as an upper bound).
    """

    record: RoundRecord
    stop: bool
    sigterm: bool
    requeue: bool
    rebalanced: bool
    resized: bool


class RoundLedger:
    """Costs, jitters, requests and records of one rank's fit (see the module docstring).

    Args:
        world_size / rank: this rank's place.
        now: the clock of the records' ``time`` and of the rounds' fixed cost.
    """

    def __init__(self, world_size: int, rank: int, now: Callable[[], float] = time.perf_counter) -> None:
        self.world_size = world_size
        self.rank = rank
        self._now = now
        self.history: list[RoundRecord] = []
        self.num_averagings = 0
        self.round_cost = 0.0  # the agreed fixed cost of one round, as the solver prices it
        self.allreduce_time = 0.0  # the agreed duration of the last all-reduce alone
        self.jitter = [0.0] * world_size  # every rank's smoothed step log-spread, agreed (deadline rounds)
        self.last_allreduce = 0.0  # this rank's last all-reduce, reported in the next round's control data
        self.last_overhead = 0.0  # this rank's last round outside its own steps, reported likewise
        self._costs: deque[float] = deque(maxlen=COST_WINDOW)  # the last rounds' agreed fixed costs
        self._started = now()
        self._excluded = 0.0  # seconds of validation since the start: not training time
        self._round_started: float | None = None  # when this rank's current round began (last averaging's end)
        self.stop = self.sigterm = self.requeue = False

    def begin_fit(self) -> None:
        self._started = self._now()
        self._excluded = 0.0
        self._round_started = None
        self._costs.clear()

    def exclude_time(self, seconds: float) -> None:
        """``seconds`` spent outside training: neither the records' ``time`` nor the round's cost includes them."""
        self._excluded += max(0.0, seconds)
        if self._round_started is not None:
            self._round_started += max(0.0, seconds)

    # ------------------------------------------------------------------ requests

    def request_stop(self) -> None:
        self.stop = True

    def request_sigterm(self) -> bool:
        """Record a SIGTERM; return whether it is the first."""
        first, self.sigterm = not self.sigterm, True
        return first

    def request_requeue(self) -> None:
        self.requeue = True

    def requests_answered(self, summed: ControlData) -> None:
        """The requests travelled in an averaging: a stop is acted on, a requeue handled (SIGTERM stays: it ends
        the fit)."""
        self.stop = False
        if summed.requeue:
            self.requeue = False

    # ------------------------------------------------------------------ an averaging

    def enter(self, summed: ControlData, allreduce_s: float, compute_s: float) -> float:
        """Everyone's control data of an averaging that took ``allreduce_s`` here (this rank's steps took
        ``compute_s`` of its round): update the costs and jitters every rank agrees on; return the time now."""
        self.last_allreduce = allreduce_s
        self.num_averagings += 1
        steps = {r.global_step for r in summed.ranks}
        if len(steps) > 1:
            raise RuntimeError(
                f"Ranks disagree on global_step ({sorted(steps)}). Under manual optimization oscars needs every"
                " training_step to call optimizer.step() the same number of times."
            )
        costs = [r.allreduce for r in summed.ranks if r.allreduce > 0.0]
        if costs:  # the last rank to arrive waits least: its duration is the closest to the transfer cost
            self.allreduce_time = min(costs)
        overheads = [r.overhead for r in summed.ranks if r.overhead > 0.0]
        if overheads:  # likewise the busiest rank spends least of its round outside its own steps
            self._costs.append(max(min(overheads), self.allreduce_time))
        # The solver prices the median recent fixed cost per round (one slow round does not re-solve the schedule).
        # Until a whole round has been measured it is unknown (0): the first schedule is solved as if averaging were
        # free and re-solved once, when the cost becomes known.
        self.round_cost = statistics.median(self._costs) if self._costs else 0.0
        for rank, report in enumerate(summed.ranks):
            if report.jitter > 0.0:
                old = self.jitter[rank]
                self.jitter[rank] = report.jitter if old <= 0.0 else old + JITTER_SMOOTHING * (report.jitter - old)
        now = self._now()
        if self._round_started is not None:
            self.last_overhead = max(0.0, now - self._round_started - compute_s)
        self._round_started = now
        return now

    def training_time(self, now: float) -> float:
        """Seconds of training since the fit began, at ``now``."""
        return now - self._started - self._excluded

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {"round_cost": self.round_cost, "round_costs": list(self._costs), "num_averagings": self.num_averagings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_averagings = int(state.get("num_averagings", 0))
        # "allreduce_time": the key under which older checkpoints kept the round cost
        self.round_cost = float(state.get("round_cost", state.get("allreduce_time")) or 0.0)
        self._costs.extend(float(c) for c in state.get("round_costs") or [])
