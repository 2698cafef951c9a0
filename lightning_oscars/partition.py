"""Partition arithmetic: which data every rank trains on in every round of an epoch.

Pure functions and plain objects, no torch.distributed; every rank computes the same plan.

Vocabulary:

* a *slot* is one optimizer step of the busiest rank, i.e. ``accumulate_grad_batches`` Lightning batches;
  every rank iterates the same slots, so Lightning's counters agree on all ranks;
* a *unit* is the data of one real optimizer step of one rank (``accumulate_grad_batches`` batches of the
  epoch's shuffled order); units are numbered ``0 .. total_units - 1`` and each is used once per epoch;
* a *round* is a run of slots between two averagings; rank ``i`` trains on ``quotas[i]`` of them (its
  first slots) and idles through the rest as cheap no-ops.

A round takes the next ``sum(quotas)`` units: first one unit for every rank that trains at all, in rank
order, then the rest of every rank's units, rank after rank. Because a rank's first unit does not depend on
the quotas, the first batch of a round can be fetched before the schedule for that round is known.

A *deadline round* (``deadline_rounds=True``) *reserves* ``quotas[i]`` units for rank ``i`` and lasts
``max(quotas)`` slots; the rank decides slot by slot whether its next step still fits before the round's deadline
(``deadline.py``) and trains a prefix of its reservation. :meth:`EpochPlan.settle` then hands the units nobody
trained back to the epoch: they are trained first in the following rounds, right after the next round's first
units (already fetched), so every unit is still used exactly once per epoch. The plan keeps the epoch's order of
units as a list of *positions*, which settling rewrites; rounds address positions.

*Boundaries* (``EpochPlan.boundaries``) are the slots after which Lightning validates: rounds end there
(:func:`segment_length`), so that the averaging before validation closes a round instead of cutting one. A deadline
round shortened to end there reserves less (:func:`held_reservation`) and its deadline shrinks alike
(:func:`reservation_scale`).

The *time-boxed warm-up* (``warmup.py``) lays out an epoch's first round the same way, with every rank reserving
the same number of units (``warmup_reserve``); only the slots' decisions differ.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EpochPlan",
    "deadline_epoch_slots",
    "deadline_round_fits",
    "held_reservation",
    "Round",
    "max_epoch_slots",
    "plan_rounds",
    "planned_slots",
    "reservation_scale",
    "round_quotas",
    "segment_length",
    "split_proportionally",
    "validations_after_resize",
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


@dataclass(frozen=True)
class Round:
    """One round: ``length`` slots from ``start_slot``; rank ``i`` trains ``quotas[i]`` units from position
    ``first_unit``. In a ``deadline`` round the quotas are reservations until :meth:`EpochPlan.settle` replaces
    them by what each rank trained; a ``warmup`` round is a deadline round whose slots the warm-up gate decides."""

    start_slot: int
    length: int
    quotas: tuple[int, ...]
    first_unit: int
    deadline: bool = False
    warmup: bool = False

    @property
    def end_slot(self) -> int:
        return self.start_slot + self.length

    @property
    def is_empty(self) -> bool:
        return not any(self.quotas)

    def real_offsets(self, rank: int) -> list[int]:
        """The slots (offsets from ``start_slot``) in which ``rank`` trains: its quota spread evenly over the round,
        the first at offset 0. Spread, not packed at the start, so that wherever the round is cut (validation or a
        checkpoint averages mid-round) every rank has done about the same share of its round's work, and nobody
        waits long at that extra averaging."""
        quota = self.quotas[rank]
        return [k * self.length // quota for k in range(quota)]

    def units_of(self, rank: int) -> list[int]:
        """The units rank ``rank`` trains on, in order, one per slot of :meth:`real_offsets`."""
        if self.quotas[rank] == 0:
            return []
        starters = sum(1 for q in self.quotas if q > 0)
        first = self.first_unit + sum(1 for q in self.quotas[:rank] if q > 0)
        rest = self.first_unit + starters + sum(q - 1 for q in self.quotas[:rank] if q > 0)
        return [first, *range(rest, rest + self.quotas[rank] - 1)]


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


def plan_rounds(
    local_steps: Sequence[int],
    total_units: int,
    total_slots: int,
    start_slot: int = 0,
    first_unit: int = 0,
    reserve: Sequence[int] | None = None,
    warmup_reserve: Sequence[int] | None = None,
    boundaries: Sequence[int] = (),
) -> list[Round]:
    """The rounds from ``start_slot`` to ``total_slots`` if every round follows ``local_steps``. With ``reserve``
    (per-rank reservations of deadline rounds), rounds are deadline rounds while :func:`deadline_round_fits`, laid
    out as if every reservation were trained (settling re-plans), and plain rounds after. With ``warmup_reserve``
    the first round is a time-boxed warm-up reserving that much, or as much as fits (:func:`fitting_reservation`;
    a plain round if not even ``local_steps`` fits). ``boundaries``: slots where the epoch averages whatever the
    rounds (validation): rounds end there (:func:`segment_length`, :func:`deadline_reservation`) rather than being
    cut short by them, so that no rank waits at that averaging for another's share of a cut round."""
    steps = tuple(local_steps)
    rounds: list[Round] = []
    slot, unit = start_slot, first_unit
    warmup = None
    if warmup_reserve is not None:
        warmup = fitting_reservation(warmup_reserve, steps, total_units - unit, total_slots - slot)
    if warmup is not None:
        rounds.append(Round(slot, max(warmup), warmup, unit, deadline=True, warmup=True))
        slot += max(warmup)
        unit += sum(warmup)
    while slot < total_slots:
        if reserve is not None and deadline_round_fits(reserve, total_units - unit, total_slots - slot):
            held = deadline_reservation(slot, reserve, boundaries, total_slots)  # fits too: it is no larger
            rounds.append(Round(slot, max(held), held, unit, deadline=True))
            slot += max(held)
            unit += sum(held)
            continue
        short = segment_length(slot, max(steps), boundaries, total_slots)
        quotas = tuple(round_quotas(steps, total_units - unit, total_slots - slot, short))
        length = max(quotas) if any(quotas) else total_slots - slot
        if short is not None and any(quotas):
            length = max(length, min(short, total_slots - slot))  # a short round ends on its boundary
        rounds.append(Round(slot, length, quotas, unit))
        slot += length
        unit += sum(quotas)
    return rounds


def planned_slots(local_steps: Sequence[int], total_units: int) -> int:
    """Slots needed to use every unit once when every round follows ``local_steps``."""
    steps = tuple(local_steps)
    per_round = sum(steps)
    full_rounds = total_units // per_round
    slots = full_rounds * max(steps)
    left = total_units - full_rounds * per_round
    if left:
        slots += max(round_quotas(steps, left, max(steps)))
    return slots


def deadline_epoch_slots(units_per_round: float, length: int, total_units: int) -> int:
    """Slots of an epoch of deadline rounds of ``length`` slots that train ``units_per_round`` units each, as
    expected, sized 5% pessimistically: the epoch is cut at its end when the units run out sooner, and a shortfall
    is caught up by the plain rounds the epoch ends with."""
    per_round = max(1.0, 0.95 * units_per_round)
    return math.ceil(total_units / per_round) * length + length


def max_epoch_slots(total_units: int, world_size: int, most_steps: int, last_round: int) -> int:
    """The most slots an epoch of ``total_units`` can need when in every round the busiest rank takes at most
    ``most_steps`` local steps and every other rank at least one (every schedule either solver returns).

    A round whose busiest rank takes ``m`` steps lasts ``m`` slots and uses at least ``m + world_size - 1``
    units, so it needs at most ``m / (m + world_size - 1)`` slots per unit, the most at ``m = most_steps``
    (rounds where everybody takes the same steps need only ``1 / world_size``). Only the epoch's last round
    can be partial: ``last_round`` bounds its slots. Never more than ``total_units``.
    """
    if world_size < 1 or most_steps < 1 or last_round < 0 or total_units < 0:
        raise ValueError(f"invalid bound arguments: {total_units=}, {world_size=}, {most_steps=}, {last_round=}")
    full = total_units * most_steps // (most_steps + world_size - 1)
    return min(total_units, full + last_round)


class EpochPlan:
    """The rounds of one epoch; later rounds are re-planned when the schedule changes at a round boundary."""

    def __init__(
        self,
        world_size: int,
        total_units: int,
        total_slots: int,
        local_steps: Sequence[int],
        reserve: Sequence[int] | None = None,
        warmup_reserve: Sequence[int] | None = None,
        boundaries: Callable[[int], Sequence[int]] | None = None,
    ) -> None:
        for name, given in (("local_steps", local_steps), ("reserve", reserve), ("warmup_reserve", warmup_reserve)):
            if given is not None and len(given) != world_size:
                raise ValueError(f"{name} does not have {world_size} entries, one per rank")
        for given in (reserve, warmup_reserve):
            if given is not None and any(r < t or r < 1 for r, t in zip(given, local_steps)):
                raise ValueError(f"reservations {list(given)} must be >= 1 and >= local_steps {list(local_steps)}")
        self.world_size = world_size
        self.total_units = total_units
        self.total_slots = total_slots
        self.version = 0
        self.order: list[int] | None = None  # position -> unit once a deadline round handed units back
        self.progress: tuple[int, ...] = (0,) * world_size  # units trained in the current round at the last averaging
        # epoch slots -> the slots where the epoch averages anyway (validation): plain rounds end there. A hint: a
        # wrong one only makes those averagings cut a round, as without it.
        self.boundaries = boundaries
        self._rounds = plan_rounds(
            local_steps,
            total_units,
            total_slots,
            reserve=reserve,
            warmup_reserve=warmup_reserve,
            boundaries=self.boundary_slots(),
        )
        self._starts = [r.start_slot for r in self._rounds]

    def boundary_slots(self) -> Sequence[int]:
        """The slots after which this epoch averages anyway (validation), as the plan expects them."""
        return self.boundaries(self.total_slots) if self.boundaries is not None else ()

    def unit(self, position: int) -> int:
        """The unit at ``position`` of the epoch's order of units."""
        return position if self.order is None else self.order[position]

    @property
    def rounds(self) -> tuple[Round, ...]:
        return tuple(self._rounds)

    def round_at(self, slot: int) -> Round:
        index = bisect.bisect_right(self._starts, slot) - 1
        if index < 0 or slot >= self.total_slots:
            raise IndexError(f"slot {slot} is outside the epoch (0..{self.total_slots - 1})")
        return self._rounds[index]

    def unit_at(self, rank: int, slot: int) -> int | None:
        """The unit ``rank`` trains on at ``slot``, or ``None`` if that slot is a no-op for it."""
        rnd = self.round_at(slot)
        offsets = rnd.real_offsets(rank)
        index = bisect.bisect_left(offsets, slot - rnd.start_slot)
        if index == len(offsets) or offsets[index] != slot - rnd.start_slot:
            return None
        return self.unit(rnd.units_of(rank)[index])

    def reserved_units(self, rank: int, rnd: Round) -> list[int]:
        """The units ``rank`` trains (or, in a deadline round, may train, in this order) in ``rnd``."""
        return [self.unit(p) for p in rnd.units_of(rank)]

    def replan(
        self,
        start_slot: int,
        local_steps: Sequence[int],
        shrink: bool = False,
        reserve: Sequence[int] | None = None,
        units_per_round: float = 0.0,
        max_slots: int | None = None,
    ) -> None:
        """Re-plan every round from ``start_slot`` (which must start a round) with new local steps.

        With ``shrink``, an epoch sized as an upper bound (speeds unknown) is cut to the slots the new local
        steps need for the units left; otherwise ``total_slots`` is kept and spare slots become no-ops. With
        ``max_slots`` (the loader's length), an epoch of plain rounds is re-sized to exactly the slots the new local
        steps need, grown up to ``max_slots`` or cut: kept at its old size, a schedule that trains fewer units per
        slot than the one the epoch was sized for would push every rank beyond its local steps until the epoch ends
        (the slow rank most, so the fast ones wait), and one that trains more would end the epoch in idle slots.
        With ``reserve``, deadline rounds expected to train ``units_per_round``; the epoch is sized by
        :func:`deadline_epoch_slots` when ``shrink``, and cut to its exact end once only plain rounds are left.
        """
        index = bisect.bisect_left(self._starts, start_slot)
        if index == len(self._starts) or self._starts[index] != start_slot:
            raise ValueError(f"slot {start_slot} does not start a round")
        # From the rounds before: a settled deadline round may have trained fewer units than it reserved.
        before = self._rounds[index - 1] if index else None
        first_unit = before.first_unit + sum(before.quotas) if before else self._rounds[0].first_unit
        left = self.total_units - first_unit
        if shrink and reserve is not None:
            needed = start_slot + deadline_epoch_slots(units_per_round or sum(local_steps), max(reserve), left)
            self.total_slots = max(start_slot, min(self.total_slots, needed))
        elif reserve is None and max_slots is not None:
            needed = start_slot + planned_slots(local_steps, left)
            self.total_slots = max(start_slot, min(max(max_slots, self.total_slots), needed))
        elif shrink:
            needed = start_slot + planned_slots(local_steps, left)
            self.total_slots = max(start_slot, min(self.total_slots, needed))
        rounds = plan_rounds(
            local_steps,
            self.total_units,
            self.total_slots,
            start_slot,
            first_unit,
            reserve,
            None,
            self.boundary_slots(),
        )
        if reserve is not None and not any(r.deadline for r in rounds):  # the plain tail: its end is known
            self.total_slots = max(start_slot, min(self.total_slots, start_slot + planned_slots(local_steps, left)))
            rounds = plan_rounds(
                local_steps,
                self.total_units,
                self.total_slots,
                start_slot,
                first_unit,
                boundaries=self.boundary_slots(),
            )
        self._rounds[index:] = rounds
        self._starts = [r.start_slot for r in self._rounds]
        self.version += 1

    def settle(self, start_slot: int, trained: Sequence[int]) -> bool:
        """The deadline round starting at ``start_slot`` is over: rank ``i`` trained the first ``trained[i]`` units
        of its reservation. The units nobody trained move behind the next round's first units (already fetched);
        the caller re-plans from the next round. Returns whether anything was handed back."""
        index = bisect.bisect_left(self._starts, start_slot)
        if index == len(self._starts) or self._starts[index] != start_slot or not self._rounds[index].deadline:
            raise ValueError(f"slot {start_slot} does not start a deadline round")
        rnd = self._rounds[index]
        trained = tuple(int(t) for t in trained)
        if len(trained) != self.world_size or any(not 0 <= t <= q for t, q in zip(trained, rnd.quotas)):
            raise ValueError(f"trained {list(trained)} is not within the reservations {list(rnd.quotas)}")
        self.progress = (0,) * self.world_size
        if trained == rnd.quotas:
            return False
        order = self.order if self.order is not None else list(range(self.total_units))
        start, end = rnd.first_unit, rnd.first_unit + sum(rnd.quotas)
        reserved = [rnd.units_of(r) for r in range(self.world_size)]
        settled = dataclasses.replace(rnd, quotas=trained)
        segment = [0] * sum(trained)
        returned: list[int] = []
        for rank, positions in enumerate(reserved):
            for new, old in zip(settled.units_of(rank), positions):
                segment[new - start] = order[old]
            returned += [order[p] for p in positions[trained[rank] :]]
        starters = order[end : end + self.world_size]
        order[start:] = segment + starters + returned + order[end + self.world_size :]
        self.order = order
        self._rounds[index] = settled
        return True

    def units_used(self) -> int:
        return sum(sum(r.quotas) for r in self._rounds)

    def state_dict(self) -> dict[str, Any]:
        return {
            "total_units": self.total_units,
            "total_slots": self.total_slots,
            "rounds": [
                [r.start_slot, r.length, list(r.quotas), r.first_unit, r.deadline, r.warmup] for r in self._rounds
            ],
            "order": self.order,
            "progress": list(self.progress),
        }

    @classmethod
    def from_state_dict(cls, world_size: int, state: dict[str, Any]) -> EpochPlan:
        """The plan :meth:`state_dict` saved (a checkpoint written mid-epoch), re-planned rounds included."""
        plan = cls(world_size, state["total_units"], state["total_slots"], (1,) * world_size)
        plan._rounds = [
            Round(r[0], r[1], tuple(r[2]), r[3], len(r) > 4 and bool(r[4]), len(r) > 5 and bool(r[5]))
            for r in state["rounds"]
        ]
        plan._starts = [r.start_slot for r in plan._rounds]
        plan.order = state.get("order")
        plan.progress = tuple(state.get("progress") or (0,) * world_size)
        return plan


def validations_after_resize(done: int, new_batches: int, due: int) -> tuple[int, ...]:
    """The batch counts (1-based) at which an epoch re-sized to ``new_batches`` batches, after ``done`` of them passed
    their validation check, runs the ``due`` validations it still owed.

    Evenly spaced over the rest of the epoch, the last at its end (an interval of the new length rarely fits: with
    130 batches left after 40, no divisor of the length validates exactly twice). Fewer when fewer batches are left."""
    left = new_batches - done
    due = min(due, left)
    return tuple(done + -(-k * left // due) for k in range(1, due + 1)) if due > 0 else ()
