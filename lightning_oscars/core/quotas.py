"""Quota arithmetic: how a round's units are split between ranks, and how many slots an epoch needs.

A rank's quota in a round is its local steps, capped by what the round and the epoch have left; a round's units are
split in proportion to the ranks' steps (:func:`round_quotas`). :func:`planned_slots` and :func:`max_epoch_slots` size
an epoch from a schedule (the second for every schedule the solvers can return: the loader's length). Pure; used by
``partition.py``'s plans and by the policy's epoch bound.

*Widths* (per-rank batch sizes): a rank whose batch is ``widths[i]`` blocks of samples trains ``widths[i]`` units per
step. Its quota is then counted in units, ``local_steps[i] * widths[i]`` in a full round, and its real steps in the
round are ``ceil(quota / width)`` (a tail step may hold fewer units). Without widths every step is one unit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import reduce

__all__ = [
    "block_widths",
    "max_epoch_slots",
    "planned_slots",
    "round_quotas",
    "split_proportionally",
    "steps_of",
    "unit_quotas",
    "within_spread",
]


def split_proportionally(weights: Sequence[float], total: int, caps: Sequence[int], floors: Sequence[int]) -> list[int]:
    """Integers ``floors[i] <= q[i] <= caps[i]`` summing to ``total`` (clamped to the feasible range),
    distributed as close to proportional to ``weights`` as the bounds allow (water-filling, then largest
    remainders; ties go to the lower rank so every rank computes the same answer)."""
    n = len(weights)
    if not (len(caps) == len(floors) == n):
        raise ValueError("weights, caps and floors must have the same length")
    if any(f > c for f, c in zip(floors, caps)):
        raise ValueError("every floor must be <= its cap")
    total = max(sum(floors), min(total, sum(caps)))

    def filled(level: float) -> list[float]:
        return [min(float(c), max(float(f), level * w)) for w, c, f in zip(weights, caps, floors)]

    lo, hi = 0.0, 1.0
    while sum(filled(hi)) < total and hi < 1e18:
        hi *= 2.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        if sum(filled(mid)) < total:
            lo = mid
        else:
            hi = mid
    shares = filled(hi)
    quotas = [max(f, min(c, int(math.floor(s + 1e-9)))) for s, c, f in zip(shares, caps, floors)]
    missing = total - sum(quotas)
    order = sorted(range(n), key=lambda i: (-(shares[i] - quotas[i]), i))
    while missing > 0:
        progressed = False
        for i in order:
            if missing and quotas[i] < caps[i]:
                quotas[i] += 1
                missing -= 1
                progressed = True
        if not progressed:
            break
    order = sorted(range(n), key=lambda i: (shares[i] - quotas[i], -i))
    while missing < 0:
        for i in order:
            if missing and quotas[i] > floors[i]:
                quotas[i] -= 1
                missing += 1
    return quotas


def round_quotas(
    local_steps: Sequence[int], remaining_units: int, remaining_slots: int, length: int | None = None
) -> list[int]:
    """Real steps of every rank in the next round.

    Normally ``local_steps`` itself. Near the end of the epoch the quotas shrink to the data that is left;
    if the remaining slots are too few to use up the remaining data at ``local_steps`` (speeds drifted after
    the epoch was sized), the quotas grow, up to the round length, so that no data is skipped.
    Rank ``i`` gets at least one step while ``i < remaining_units``. With ``length`` shorter than the local steps'
    longest, the round lasts ``length`` slots and the local steps are scaled down to it in proportion (a round that
    must end before a validation: every rank still does its share of the round's time).
    """
    n = len(local_steps)
    if remaining_units <= 0 or remaining_slots <= 0:
        return [0] * n
    longest = max(local_steps)
    length = min(longest if length is None else max(1, min(length, longest)), remaining_slots)
    floors = [1 if i < remaining_units else 0 for i in range(n)]
    caps = [length] * n
    quotas = [max(f, min(t, length)) for t, f in zip(local_steps, floors)]
    if length < longest and length < remaining_slots:  # a shortened round, not the epoch's tail: scale
        share = round(sum(local_steps) * length / longest)
        quotas = split_proportionally([float(t) for t in local_steps], share, caps, floors)
    rounds_left = -(-remaining_slots // length)
    # Spread the backlog over the rounds left, but take now whatever the later slots cannot hold (at most one
    # unit per rank and slot): the rounds left may be fewer or shorter than full ones at ``local_steps``.
    backlog = remaining_units - n * (remaining_slots - length)
    needed = min(remaining_units, max(-(-remaining_units // rounds_left), backlog))
    if sum(quotas) > remaining_units or sum(quotas) < needed:
        target = remaining_units if sum(quotas) > remaining_units else needed
        quotas = split_proportionally([float(t) for t in local_steps], target, caps, floors)
    return quotas


def block_widths(batch_sizes: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """The block of samples per-rank batch sizes share (their greatest common divisor), and each rank's batch in
    blocks: ``[64, 32]`` -> ``(32, (2, 1))``."""
    if not batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be positive integers, got {list(batch_sizes)}")
    block = reduce(math.gcd, batch_sizes)
    return block, tuple(b // block for b in batch_sizes)


def within_spread(local_steps: tuple[int, ...], spread: int | None) -> tuple[int, ...]:
    """``local_steps`` within ``spread`` of the fewest (``None``: as they are). In lockstep (a spread of 0) every rank
    takes the busiest rank's steps: ranks wait for each other at every step anyway, so a round lasts as long as the
    schedule's rounds and its meeting is paid as rarely."""
    if spread is None or not local_steps:
        return local_steps
    if spread == 0:
        return (max(local_steps),) * len(local_steps)
    most = min(local_steps) + spread
    return tuple(min(t, most) for t in local_steps)


def steps_of(quota: int, width: int) -> int:
    """Real steps of a rank that trains ``quota`` units, ``width`` per step."""
    return -(-quota // width)


def unit_quotas(
    local_steps: Sequence[int],
    widths: Sequence[int] | None,
    remaining_units: int,
    remaining_slots: int,
    length: int | None = None,
) -> list[int]:
    """:func:`round_quotas` counted in units when rank ``i`` trains ``widths[i]`` units per step (``None`` or all
    ones: :func:`round_quotas` itself). A full round gives rank ``i`` ``local_steps[i] * widths[i]`` units; a round
    shortened to ``length`` scales the steps down in proportion; near the epoch's end, or when the slots left cannot
    hold the units left at these quotas, the units are split in proportion to them, at most ``length`` steps'
    worth per rank, so that no data is skipped."""
    if widths is None or all(w == 1 for w in widths):
        return round_quotas(local_steps, remaining_units, remaining_slots, length)
    n = len(local_steps)
    if len(widths) != n or any(w < 1 for w in widths):
        raise ValueError(f"widths {list(widths)} must be {n} positive integers, one per rank")
    if remaining_units <= 0 or remaining_slots <= 0:
        return [0] * n
    longest = max(local_steps)
    length = min(longest if length is None else max(1, min(length, longest)), remaining_slots)
    steps = [min(t, length) for t in local_steps]
    if length < longest and length < remaining_slots:  # a shortened round, not the epoch's tail: scale
        share = round(sum(local_steps) * length / longest)
        steps = split_proportionally([float(t) for t in local_steps], share, [length] * n, [1] * n)
    quotas = [max(1, s) * w for s, w in zip(steps, widths)]
    caps = [length * w for w in widths]
    floors = [1 if i < remaining_units else 0 for i in range(n)]
    rounds_left = -(-remaining_slots // length)
    backlog = remaining_units - sum(widths) * (remaining_slots - length)  # what the later slots cannot hold
    needed = min(remaining_units, max(-(-remaining_units // rounds_left), backlog))
    if sum(quotas) > remaining_units or sum(quotas) < needed:
        target = remaining_units if sum(quotas) > remaining_units else needed
        quotas = split_proportionally([float(t * w) for t, w in zip(local_steps, widths)], target, caps, floors)
    return quotas


def planned_slots(local_steps: Sequence[int], total_units: int, widths: Sequence[int] | None = None) -> int:
    """Slots needed to use every unit once when every round follows ``local_steps`` (rank ``i`` training
    ``widths[i]`` units per step)."""
    steps = tuple(local_steps)
    sizes = tuple(widths) if widths is not None else (1,) * len(steps)
    per_round = sum(t * w for t, w in zip(steps, sizes))
    full_rounds = total_units // per_round
    slots = full_rounds * max(steps)
    left = total_units - full_rounds * per_round
    if left:
        quotas = unit_quotas(steps, sizes, left, max(steps))
        slots += max(steps_of(q, w) for q, w in zip(quotas, sizes))
    return slots


def max_epoch_slots(total_units: int, world_size: int, most_steps: int, last_round: int) -> int:
    """The most slots an epoch of ``total_units`` can need when in every round the busiest rank takes at most
    ``most_steps`` local steps and every other rank at least one (every schedule either solver returns).

    A round whose busiest rank takes ``m`` steps lasts ``m`` slots and uses at least ``m + world_size - 1``
    units, so it needs at most ``m / (m + world_size - 1)`` slots per unit, the most at ``m = most_steps``
    (rounds where everybody takes the same steps need only ``1 / world_size``). Only the epoch's last round
    can be partial: ``last_round`` bounds its slots. Never more than ``total_units``. A bound with widths too:
    every step trains at least one unit.
    """
    if world_size < 1 or most_steps < 1 or last_round < 0 or total_units < 0:
        raise ValueError(f"invalid bound arguments: {total_units=}, {world_size=}, {most_steps=}, {last_round=}")
    full = total_units * most_steps // (most_steps + world_size - 1)
    return min(total_units, full + last_round)
