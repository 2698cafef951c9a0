"""Deadline rounds: every rank keeps training while its next step is expected to end before the round's deadline.

A fixed number of local steps per round loses to per-step jitter: the round lasts as long as the unluckiest
rank's ``tau_i`` steps, and everyone else waits. In a deadline round (``OscarsStrategy(deadline_rounds=True)``)
the round has a length in *seconds*, ``D``, and a rank's number of steps is decided slot by slot: a slot is a real
step while the step is expected to end by ``D`` even if it is slow (its :data:`QUANTILE` quantile fits), and a
no-op after. A lucky rank trains more than ``tau_i``, an unlucky one fewer; nobody waits for the tail of somebody
else's jitter.

``D`` (:func:`plan_deadline`) is the shortest deadline, from the schedule's period ``max_i tau_i * t_i`` up to
``max_local_steps`` steps of the fastest rank, whose simulated throughput is within 1% of the best: every rank
computes it from the same agreed figures (each rank's median step time ``t_i`` and jitter ``sigma_i``, the
log-spread of its steps, measured each round), with the same seeded draws, so all agree. Each rank *reserves*
enough units to keep stepping until ``D`` (:func:`reservations`); the round lasts as many slots as the largest
reservation, and the units a rank did not reach go back to the epoch (``EpochPlan.settle``). The real steps are
spread over the round's slots, not packed at its start, so that wherever validation or a checkpoint cuts the round,
every rank has done about its share.

Pure: no Lightning, no torch.distributed; the clock is injected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import torch

__all__ = ["QUANTILE", "DeadlinePacer", "DeadlineRound", "plan_deadline", "quantile_step", "reservations"]

# A step starts only if this quantile of its duration still ends by the deadline: with many ranks, one step that
# overruns the deadline holds up everyone, so a rank judges its next step by a slow case, not a typical one.
QUANTILE = 0.9
# Deadlines tried: the schedule's period, then longer in steps of this fraction of it.
MARGIN_STEP = 0.05


@dataclass(frozen=True)
class DeadlineRound:
    """What every rank agrees on for its deadline rounds.

    Attributes:
        deadline_s: the round's length in seconds (its steps; the averaging comes after).
        reserve: units each rank reserves per round (:func:`reservations`).
        expected_units: units all ranks together are expected to train per round (sizes the epoch).
    """

    deadline_s: float
    reserve: tuple[int, ...]
    expected_units: float


def reservations(deadline_s: float, step_times: Sequence[float], local_steps: Sequence[int]) -> tuple[int, ...]:
    """Units each rank reserves in a deadline round of ``deadline_s``: enough for a run of steps 10% faster than
    its median to last until the deadline, and more than its local steps."""
    if any(t < 1 for t in local_steps) or any(t <= 0.0 for t in step_times) or deadline_s <= 0.0:
        raise ValueError(f"invalid deadline {deadline_s!r}, step times {list(step_times)} or steps {list(local_steps)}")
    return tuple(max(tau + 1, math.ceil(1.1 * deadline_s / t) + 1) for t, tau in zip(step_times, local_steps))


def quantile_step(step_s: float, sigma: float) -> float:
    """The :data:`QUANTILE` quantile of a step whose median is ``step_s`` and log-spread ``sigma``."""
    return step_s * math.exp(NormalDist().inv_cdf(QUANTILE) * max(0.0, sigma))


def deadline_steps(draws: torch.Tensor, quantile_s: torch.Tensor, deadline_s: float) -> torch.Tensor:
    """Steps every rank (row) takes before ``deadline_s``: the first always, then the next while its quantile
    ``quantile_s`` would end by the deadline. ``draws``: ranks x reservation step times (``inf`` past the rank's
    reservation)."""
    starts = torch.cumsum(draws, dim=-1) - draws
    allowed = starts + quantile_s[:, None] <= deadline_s * (1.0 + 1e-9)  # a step ending exactly at it fits
    allowed[..., 0] = True
    allowed &= torch.isfinite(draws)
    return torch.cumprod(allowed.to(torch.int64), dim=-1).sum(dim=-1)


def plan_deadline(
    step_times: Sequence[float],
    sigmas: Sequence[float],
    local_steps: Sequence[int],
    round_cost_s: float,
    max_local_steps: int,
    rounds: int = 16,
    tolerance: float = 0.01,
    seed: int = 0,
) -> DeadlineRound:
    """The deadline rounds for these ranks: the shortest deadline, from the schedule's period ``max_i tau_i * t_i``
    up to ``max_local_steps`` steps of the fastest rank, whose simulated steps per second are within ``tolerance``
    of the best. Each rank's steps are lognormal around ``step_times[i]`` with log-spread ``sigmas[i]``; a round
    ends at the last rank's last step plus ``round_cost_s``. Deterministic: every rank computes the same."""
    n = len(step_times)
    if not (len(sigmas) == len(local_steps) == n) or n == 0:
        raise ValueError("step_times, sigmas and local_steps need one entry per rank")
    period = max(tau * t for tau, t in zip(local_steps, step_times))
    longest = max(period, max_local_steps * min(step_times))
    candidates = [period * (1.0 + MARGIN_STEP * k) for k in range(int((longest / period - 1.0) / MARGIN_STEP) + 1)]
    if all(s <= 0.0 for s in sigmas):
        candidates = candidates[:1]  # no jitter: the period fits every rank's local steps exactly
    times = torch.tensor(step_times, dtype=torch.float64)
    sigma = torch.tensor([max(0.0, s) for s in sigmas], dtype=torch.float64)
    quantile_s = torch.tensor([quantile_step(t, s) for t, s in zip(step_times, sigmas)], dtype=torch.float64)
    width = max(reservations(candidates[-1], step_times, local_steps))
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn((rounds, n, width), generator=generator, dtype=torch.float64)
    draws = times[None, :, None] * torch.exp(sigma[None, :, None] * noise)
    best: tuple[float, DeadlineRound] | None = None
    results = []
    for deadline in candidates:
        reserve = reservations(deadline, step_times, local_steps)
        beyond = torch.arange(width)[None, :] >= torch.tensor(reserve)[:, None]
        taken = deadline_steps(draws.masked_fill(beyond, math.inf), quantile_s, deadline)  # rounds x ranks
        ends = torch.cumsum(draws.masked_fill(beyond, 0.0), dim=-1).gather(-1, (taken - 1)[..., None])
        steps = float(taken.sum())
        wall = float(ends.squeeze(-1).amax(dim=-1).sum()) + rounds * round_cost_s
        results.append((steps / wall, DeadlineRound(deadline, reserve, steps / rounds)))
        if best is None or results[-1][0] > best[0]:
            best = results[-1]
    assert best is not None
    return next(plan for score, plan in results if score >= (1.0 - tolerance) * best[0])


class DeadlinePacer:
    """Decides, for one rank, which slots of a deadline round are real steps (see the module docstring).

    The round controller calls :meth:`start_round` when a round begins (the end of the averaging) and
    :meth:`shift` when time outside training (validation) passes; the loader asks :meth:`is_due` for each slot
    as Lightning fetches it, or just before (``SlotCursor.decide_ahead``). Slots fetched but not yet run count with
    their expected time (``pending``; Lightning fetches a sized loader's batches one at a time, so usually none).
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter, packed: bool = False) -> None:
        self._now = now
        self.deadline_s = 0.0
        self.step_s = 0.0
        self.quantile_s = 0.0
        self.started: float | None = None
        self._credit = 0.0
        # Packed: the real steps come first, and once a slot is a no-op so is every later slot of the round (a
        # lockstep scheme reads "my next slot is a no-op" as "I take no further step in this round").
        self.packed = packed
        self._done = False

    def start_round(self, deadline_s: float, step_s: float, quantile_s: float | None = None) -> None:
        """A round starts now: its steps should end within ``deadline_s``; this rank's steps take ``step_s`` typically
        and ``quantile_s`` in a slow case (default: ``step_s``)."""
        quantile_s = step_s if quantile_s is None else quantile_s
        if min(deadline_s, step_s, quantile_s) < 0.0 or not math.isfinite(deadline_s + step_s + quantile_s):
            raise ValueError(f"invalid deadline {deadline_s!r} or step times {step_s!r}, {quantile_s!r}")
        self.deadline_s, self.step_s, self.quantile_s = deadline_s, step_s, max(step_s, quantile_s)
        self.started = self._now()
        self._credit = 0.0
        self._done = False

    def shift(self, seconds: float) -> None:
        """``seconds`` outside training passed (validation): the deadline moves by as much."""
        if self.started is not None:
            self.started += max(0.0, seconds)

    def is_due(self, offset: int, length: int, taken: int, reserved: int, pending: int) -> bool:
        """Whether slot ``offset`` (of ``length``) is a real step, given that ``taken`` of the ``reserved`` units
        were already handed out this round and ``pending`` of those are fetched but not yet run.

        The first slot always is (it is fetched before the round's schedule is known). After that, the steps that
        still fit (typical steps, the last one a slow case) are spread over the slots left: a slot is real once the
        accumulated share ``steps_that_fit / slots_left`` reaches a whole step. :attr:`packed`: every slot is real while
        a step fits, and none after the first that is not."""
        if offset == 0:
            self._done = False  # a new round (also where the round was entered without start_round)
            return taken < reserved
        if taken >= reserved or (self.packed and self._done):
            self._done = True
            return False
        if self.started is None:  # resumed mid-round from a checkpoint: the round restarts its clock here
            self.started = self._now()
        if self.step_s <= 0.0:
            return True
        left = self.started + self.deadline_s - self._now() - pending * self.step_s
        if left < self.quantile_s:
            self._done = True
            return False
        if self.packed:
            return True
        fits = 1 + math.floor((left - self.quantile_s) / self.step_s)
        slots_left = length - offset
        self._credit += min(1.0, fits / slots_left)
        if self._credit >= 1.0 - 1e-9:
            self._credit -= 1.0
            return True
        return False
