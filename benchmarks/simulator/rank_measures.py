"""What a simulated rank measures of its steps and reports at an averaging, as the strategy's ranks do: the seconds of
each real step (no-op slots included), its row of the control data (``RoundController.contribution``'s), and the
steps it takes in a time-boxed warm-up round.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from lightning_oscars.core.control import RankReport
from lightning_oscars.core.ledger import MEDIAN_ERROR

__all__ = ["measured_steps", "rank_reports", "timed_warmup_steps"]


def measured_steps(draws: np.ndarray, real: np.ndarray, noop: np.ndarray) -> np.ndarray:
    """The seconds a live rank measures for each of its real steps: the step itself, plus the no-op slots since its
    previous real step in the round (a step's interval starts where the previous one ended; the round's first starts
    at its own start). ``noop``: each rank's seconds per no-op slot. NaN where a slot is not real."""
    noops_before = np.cumsum(~real, axis=1)  # no-op slots up to and including each slot
    at_real = np.where(real, noops_before, -1)
    previous = np.maximum.accumulate(np.where(real, noops_before, -1), axis=1)  # at the last real slot so far
    previous = np.concatenate([np.full((real.shape[0], 1), -1), previous[:, :-1]], axis=1)
    gaps = np.where(real & (previous >= 0), at_real - previous, 0)
    return np.where(real, draws + noop[:, None] * gaps, np.nan)


def rank_reports(
    draws: np.ndarray,
    real: np.ndarray,
    samples: np.ndarray,
    units: np.ndarray,
    global_step: int,
    allreduce: float,
    overhead: np.ndarray,
    noop: np.ndarray | None = None,
) -> tuple[RankReport, ...]:
    """Every rank's row of the control data, as ``RoundController.contribution`` writes it for a live rank.

    ``draws``: ranks x slots seconds; ``real``: which of those slots were real steps; ``noop``: each rank's seconds
    per no-op slot (:func:`measured_steps`). A rank's step time is the median of its measured steps, ``compute``
    their sum, ``error`` the median's standard error as a fraction of it (the MAD-based log-spread over the square
    root of the steps; 0 below two steps). ``allreduce`` and ``overhead``: what each rank measured of its previous
    round (0 before one was measured). No jitter: the simulator's rounds are plain.
    """
    steps = measured_steps(draws, real, np.zeros(len(draws)) if noop is None else noop)
    counts = real.sum(axis=1)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a rank without steps has an all-NaN row
        medians = np.where(counts > 0, np.nanmedian(np.where(counts[:, None] > 0, steps, 0.0), axis=1), 0.0)
        spread = np.nanmedian(np.abs(np.log(steps / np.where(medians > 0, medians, 1.0)[:, None])), axis=1)
    jitter = np.where(counts >= 2, spread / 0.6745, 0.0)
    errors = np.where(medians > 0, MEDIAN_ERROR * jitter / np.sqrt(np.maximum(counts, 1)), 0.0)
    compute = np.where(real, steps, 0.0).sum(axis=1)
    return tuple(
        RankReport(float(m), int(n), float(c), allreduce, global_step, float(o), int(u), 0.0, float(e))
        for m, n, c, o, u, e in zip(medians, samples, compute, overhead, units, errors)
    )


def timed_warmup_steps(draws: np.ndarray, warmup_steps: int, reserve: Sequence[int]) -> tuple[int, ...]:
    """Steps every rank takes in the time-boxed warm-up round (``lightning_oscars.core.warmup``): its ``warmup_steps``,
    then every step it starts before the slowest rank has finished its own (a rank decides as it fetches, at the
    step's start), within its reservation. ``draws``: ranks x slots step times."""
    ends = np.cumsum(draws, axis=1)
    done = float(ends[:, warmup_steps - 1].max())
    started = (ends - draws < done).sum(axis=1)
    return tuple(int(q) for q in np.clip(started, warmup_steps, np.asarray(reserve)))
