"""Deadline rounds: every rank keeps training while its next step is expected to end before the round's deadline.

A fixed number of local steps per round loses to per-step jitter: the round lasts as long as the unluckiest
rank's ``tau_i`` steps, and everyone else waits. In a deadline round (``OscarsStrategy(deadline_rounds=True)``)
the schedule still sets the round's length in *seconds*, ``D = max_i tau_i * t_i`` (the solved period at the
current estimates ``t_i``), but a rank's number of steps is decided slot by slot: a slot is a real step if the
step is expected to end before ``D`` (to the nearest step), and a no-op otherwise. A lucky rank trains more than
``tau_i``, an unlucky one fewer; nobody waits for the tail of somebody else's jitter.

Each rank *reserves* ``tau_i`` plus a quarter more units (:func:`reservations`), the round lasts as many slots as
the largest reservation, and the units a rank did not reach go back to the epoch (``EpochPlan.settle``). The real
steps are spread over the round's slots, not packed at its start, so that wherever validation or a checkpoint
cuts the round, every rank has done about its share.

Pure: no Lightning, no torch.distributed; the clock is injected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

__all__ = ["RESERVE_FRACTION", "DeadlinePacer", "reservations"]

# Units reserved beyond the schedule's local steps: how far ahead of its expected pace a lucky rank may train.
RESERVE_FRACTION = 0.25


def reservations(local_steps: Sequence[int]) -> tuple[int, ...]:
    """Units each rank reserves in a deadline round: its local steps plus a quarter, at least one more."""
    if any(t < 1 for t in local_steps):
        raise ValueError(f"local steps must be >= 1, got {list(local_steps)}")
    return tuple(t + max(1, math.ceil(RESERVE_FRACTION * t)) for t in local_steps)


class DeadlinePacer:
    """Decides, for one rank, which slots of a deadline round are real steps (see the module docstring).

    The round controller calls :meth:`start_round` when a round begins (the end of the averaging) and
    :meth:`shift` when time outside training (validation) passes; the loader asks :meth:`is_due` for each slot
    as Lightning fetches it. Lightning fetches one batch ahead: when slot ``k`` is decided, slot ``k - 1`` has been
    fetched but not run, and its expected time counts (``pending``).
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now = now
        self.deadline_s = 0.0
        self.step_s = 0.0
        self.started: float | None = None
        self._credit = 0.0

    def start_round(self, deadline_s: float, step_s: float) -> None:
        """A round starts now: its steps should end within ``deadline_s``; this rank expects ``step_s`` per step."""
        if deadline_s < 0.0 or step_s < 0.0 or not (math.isfinite(deadline_s) and math.isfinite(step_s)):
            raise ValueError(f"invalid deadline {deadline_s!r} or step time {step_s!r}")
        self.deadline_s, self.step_s = deadline_s, step_s
        self.started = self._now()
        self._credit = 0.0

    def shift(self, seconds: float) -> None:
        """``seconds`` outside training passed (validation): the deadline moves by as much."""
        if self.started is not None:
            self.started += max(0.0, seconds)

    def is_due(self, offset: int, length: int, taken: int, reserved: int, pending: int) -> bool:
        """Whether slot ``offset`` (of ``length``) is a real step, given that ``taken`` of the ``reserved`` units
        were already handed out this round and ``pending`` of those are fetched but not yet run.

        The first slot always is (it is fetched before the round's schedule is known). After that, the steps that
        still fit, ``n = round((deadline - elapsed - pending * step) / step)``, are spread over the slots left:
        a slot is real once the accumulated share ``n / slots_left`` reaches a whole step."""
        if taken >= reserved:
            return False
        if offset == 0:
            return True
        if self.started is None:  # resumed mid-round from a checkpoint: the round restarts its clock here
            self.started = self._now()
        if self.step_s <= 0.0:
            return True
        left = self.started + self.deadline_s - self._now() - pending * self.step_s
        fits = math.floor(left / self.step_s + 0.5)
        if fits <= 0:
            return False
        slots_left = length - offset
        self._credit += min(1.0, fits / slots_left)
        if self._credit >= 1.0 - 1e-9:
            self._credit -= 1.0
            return True
        return False
