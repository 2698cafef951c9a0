"""Reservation arithmetic of deadline rounds and the time-boxed warm-up, in one place.

A *deadline round* (``deadline_rounds=True``, and every paradigm's rounds) *reserves* units for every rank and
lasts as many slots as the largest reservation; each rank trains a prefix of its reservation, as its steps fit the
round's deadline (``deadline.py``'s pacer), and the epoch's plan (``partition.py``) hands back what nobody reached.
The time-boxed warm-up (``warmup.py``) lays the first round out the same way. This module holds what decides those
reservations: whether a deadline round still fits the epoch, how a round is shortened to end on a validation
boundary, how many slots an epoch of deadline rounds takes, and :class:`DeadlinePlanner`, which keeps one fit's
deadline round (re-planned when the agreed speeds move). Pure; every rank computes the same figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "deadline_epoch_slots",
    "deadline_reservation",
    "deadline_round_fits",
    "fitting_reservation",
    "held_reservation",
    "reservation_scale",
    "segment_length",
]


def deadline_round_fits(reserve: Sequence[int], remaining_units: int, remaining_slots: int) -> bool:
    """Whether a deadline round reserving ``reserve`` may start: after it at least one unit per rank is left (the
    next round's first units, fetched before this round is settled, must not be ones it hands back), and even if
    every rank trained only its first unit the rest still fits in the slots after it (a rank trains at most one
    unit per slot)."""
    n = len(reserve)
    length = max(reserve)
    return remaining_units - sum(reserve) >= n and remaining_units - n <= n * (remaining_slots - length)


def fitting_reservation(
    reserve: Sequence[int], floor: Sequence[int], remaining_units: int, remaining_slots: int
) -> tuple[int, ...] | None:
    """``reserve`` capped at the largest length (down to ``floor``, per rank) at which a deadline round
    :func:`deadline_round_fits`; ``None`` if not even ``floor`` fits. An epoch too short for a reservation gets a
    shorter one, not none."""
    for cap in range(max(reserve), max(floor) - 1, -1):
        capped = tuple(max(min(r, cap), f) for r, f in zip(reserve, floor))
        if deadline_round_fits(capped, remaining_units, remaining_slots):
            return capped
    return None


def segment_length(start_slot: int, longest: int, boundaries: Sequence[int], total_slots: int) -> int | None:
    """The length of a plain round starting at ``start_slot`` that ends on the next of ``boundaries`` (slots where
    the epoch averages anyway, before a validation) instead of running past it: the slots up to the boundary cut into
    equal rounds no longer than ``longest``. ``None`` when no boundary lies within a round's reach, or past it only
    the epoch's end."""
    ahead = [b for b in boundaries if start_slot < b < total_slots]
    if not ahead or min(ahead) - start_slot >= 2 * longest:
        return None  # rounds of ``longest`` until the boundary is near: the last two share what is left
    segment = min(ahead) - start_slot
    rounds = -(-segment // longest)
    return -(-segment // rounds)


def reservation_scale(longest: int, length: int) -> float:
    """How much of a deadline round reserving up to ``longest`` units is left when it is cut to ``length`` slots:
    the share of each reservation beyond its first unit (and of the deadline in seconds) that is kept. A reservation
    is the steps that fit the deadline plus one spare, so scaling the part beyond one keeps a unit for every step
    that still fits the scaled deadline."""
    if length >= longest or longest <= 1:
        return 1.0
    return max(0, length - 1) / (longest - 1)


def held_reservation(reserve: Sequence[int], length: int) -> tuple[int, ...]:
    """``reserve`` for a deadline round of ``length`` slots (one that ends on a validation boundary): every
    reservation beyond its first unit scaled by :func:`reservation_scale`, rounded up; the largest is ``length``."""
    longest = max(reserve)
    if length >= longest:
        return tuple(reserve)
    length = max(1, length)
    # integer arithmetic: every rank computes the same reservations
    return tuple(min(length, 1 + -(-(r - 1) * (length - 1) // (longest - 1))) for r in reserve)


def deadline_reservation(
    start_slot: int, reserve: Sequence[int], boundaries: Sequence[int], total_slots: int
) -> tuple[int, ...]:
    """What a deadline round starting at ``start_slot`` reserves: ``reserve``, or less when a boundary is near
    (:func:`segment_length`) so that the round ends on it."""
    short = segment_length(start_slot, max(reserve), boundaries, total_slots)
    return tuple(reserve) if short is None else held_reservation(reserve, short)


def deadline_epoch_slots(units_per_round: float, length: int, total_units: int) -> int:
    """Slots of an epoch of deadline rounds of ``length`` slots that train ``units_per_round`` units each, as
    expected, sized 5% pessimistically: the epoch is cut at its end when the units run out sooner, and a shortfall
    is caught up by the plain rounds the epoch ends with."""
    per_round = max(1.0, 0.95 * units_per_round)
    return math.ceil(total_units / per_round) * length + length
