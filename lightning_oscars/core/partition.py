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

With *widths* (per-rank batch sizes, ``quotas.py``) a unit is a block of samples and rank ``i``'s step trains
``widths[i]`` of them: its quota counts units, its first step is its first ``widths[i]`` units (still taken before
anybody's rest, so still known before the quotas), and each later step the next ``widths[i]`` of its units. Plain
rounds only: deadline rounds, the warm-up round and continuations move single units between ranks.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from lightning_oscars.core.continuation import EpochContinuation
from lightning_oscars.core.epoch_length import quickest_epoch_slots
from lightning_oscars.core.epoch_shape import validations_after_resize  # re-exported: it places validations
from lightning_oscars.core.quotas import (
    max_epoch_slots,
    planned_slots,
    round_quotas,
    split_proportionally,
    steps_of,
    unit_quotas,
)
from lightning_oscars.core.reservations import (
    deadline_epoch_slots,
    deadline_reservation,
    deadline_round_fits,
    fitting_reservation,
    held_reservation,
    reservation_scale,
    segment_length,
)
from lightning_oscars.core.round_plan import Round

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
    "unit_quotas",
    "validations_after_resize",
]


def plan_rounds(
    local_steps: Sequence[int],
    total_units: int,
    total_slots: int,
    start_slot: int = 0,
    first_unit: int = 0,
    reserve: Sequence[int] | None = None,
    warmup_reserve: Sequence[int] | None = None,
    boundaries: Sequence[int] = (),
    widths: Sequence[int] | None = None,
) -> list[Round]:
    """The rounds from ``start_slot`` to ``total_slots`` if every round follows ``local_steps``. With ``reserve``
    (per-rank reservations of deadline rounds), rounds are deadline rounds while :func:`deadline_round_fits`, laid
    out as if every reservation were trained (settling re-plans), and plain rounds after. With ``warmup_reserve``
    the first round is a time-boxed warm-up reserving that much, or as much as fits (:func:`fitting_reservation`;
    a plain round if not even ``local_steps`` fits). ``boundaries``: slots where the epoch averages whatever the
    rounds (validation): rounds end there (:func:`segment_length`, :func:`deadline_reservation`) rather than being
    cut short by them, so that no rank waits at that averaging for another's share of a cut round. ``widths``: each
    rank's units per step (plain rounds only)."""
    steps = tuple(local_steps)
    sizes = tuple(widths) if widths is not None and any(w != 1 for w in widths) else ()
    if sizes and (reserve is not None or warmup_reserve is not None):
        raise ValueError("per-rank widths apply to plain rounds only, not to deadline or warm-up rounds")
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
        quotas = tuple(unit_quotas(steps, sizes or None, total_units - unit, total_slots - slot, short))
        most = max(steps_of(q, w) for q, w in zip(quotas, sizes or (1,) * len(quotas)))
        length = most if any(quotas) else total_slots - slot
        if short is not None and any(quotas):
            length = max(length, min(short, total_slots - slot))  # a short round ends on its boundary
        rounds.append(Round(slot, length, quotas, unit, widths=sizes))
        slot += length
        unit += sum(quotas)
    return rounds


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
        continuation: EpochContinuation | None = None,
        widths: Sequence[int] | None = None,
    ) -> None:
        for name, given in (("local_steps", local_steps), ("reserve", reserve), ("warmup_reserve", warmup_reserve)):
            if given is not None and len(given) != world_size:
                raise ValueError(f"{name} does not have {world_size} entries, one per rank")
        for given in (reserve, warmup_reserve):
            if given is not None and any(r < t or r < 1 for r, t in zip(given, local_steps)):
                raise ValueError(f"reservations {list(given)} must be >= 1 and >= local_steps {list(local_steps)}")
        self.world_size = world_size
        # Units per step of every rank (per-rank batch sizes); None: one. Plain rounds only (see the module).
        uneven = widths is not None and any(w != 1 for w in widths)
        self.widths: tuple[int, ...] | None = tuple(widths) if widths is not None and uneven else None
        if self.widths is not None and (len(self.widths) != world_size or min(self.widths) < 1):
            raise ValueError(f"widths {list(self.widths)} must be {world_size} positive integers, one per rank")
        self.total_units = total_units
        self.total_slots = total_slots
        self.version = 0
        self.order: list[int] | None = None  # position -> unit once a deadline round handed units back
        self.progress: tuple[int, ...] = (0,) * world_size  # units trained in the current round at the last averaging
        # epoch slots -> the slots where the epoch averages anyway (validation): plain rounds end there. A hint: a
        # wrong one only makes those averagings cut a round, as without it.
        self.boundaries = boundaries
        # After a failed round (``continuation.py``): the slots already run are one finished round that trained the
        # consumed units, and the rounds from there on take the rest.
        done = continuation.slots if continuation is not None else 0
        first_unit = continuation.consumed if continuation is not None else 0
        if continuation is not None:
            if len(continuation.order) != total_units or done > total_slots:
                raise ValueError(f"a continuation of {len(continuation.order)} units, {done} slots does not fit")
            self.order = list(continuation.order)
        self._rounds = [Round(0, done, (first_unit,) + (0,) * (world_size - 1), 0)] if done else []
        self._rounds += plan_rounds(
            local_steps,
            total_units,
            total_slots,
            start_slot=done,
            first_unit=first_unit,
            reserve=reserve,
            warmup_reserve=warmup_reserve,
            boundaries=self.boundary_slots(),
            widths=self.widths,
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
        """The (first) unit ``rank`` trains on at ``slot``, or ``None`` if that slot is a no-op for it."""
        units = self.units_at(rank, slot)
        return units[0] if units else None

    def units_at(self, rank: int, slot: int) -> list[int] | None:
        """The units ``rank`` trains on at ``slot`` (one without widths), or ``None`` if it is a no-op for it."""
        rnd = self.round_at(slot)
        offsets = rnd.real_offsets(rank)
        index = bisect.bisect_left(offsets, slot - rnd.start_slot)
        if index == len(offsets) or offsets[index] != slot - rnd.start_slot:
            return None
        return [self.unit(p) for p in rnd.step_units(rank)[index]]

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
        step_times: Sequence[float] = (),
        round_cost: float = 0.0,
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
        With ``step_times`` (and ``round_cost``, the schedule's), plain rounds may take a few more slots than they
        need where they are predicted to run faster so (:func:`quickest_epoch_slots`).
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
        elif reserve is None and (shrink or max_slots is not None):
            most = max(max_slots, self.total_slots) if max_slots is not None else self.total_slots
            needed = min(most, start_slot + planned_slots(local_steps, left, self.widths))
            validations = self.boundaries
            if validations is not None:  # where it validates depends on the length: price the lengths

                def rounds_of(slots: int) -> list[Round]:
                    cuts, sizes = validations(slots), self.widths
                    return plan_rounds(
                        local_steps, self.total_units, slots, start_slot, first_unit, None, None, cuts, sizes
                    )

                needed = quickest_epoch_slots(rounds_of, left, step_times, round_cost, needed, most)
            self.total_slots = max(start_slot, needed)
        units, boundaries, widths = self.total_units, self.boundary_slots(), self.widths
        rounds = plan_rounds(
            local_steps, units, self.total_slots, start_slot, first_unit, reserve, None, boundaries, widths
        )
        if reserve is not None and not any(r.deadline for r in rounds):  # the plain tail: its end is known
            self.total_slots = max(start_slot, min(self.total_slots, start_slot + planned_slots(local_steps, left)))
            boundaries = self.boundary_slots()  # of the epoch's new length
            rounds = plan_rounds(local_steps, units, self.total_slots, start_slot, first_unit, boundaries=boundaries)
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
        assert self.widths is None, "deadline rounds are planned without widths"
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
            "widths": list(self.widths) if self.widths is not None else None,
        }

    @classmethod
    def from_state_dict(cls, world_size: int, state: dict[str, Any]) -> EpochPlan:
        """The plan :meth:`state_dict` saved (a checkpoint written mid-epoch), re-planned rounds included."""
        plan = cls(world_size, state["total_units"], state["total_slots"], (1,) * world_size)
        widths = state.get("widths")
        plan.widths = tuple(widths) if widths else None
        plan._rounds = [
            Round(
                r[0], r[1], tuple(r[2]), r[3], len(r) > 4 and bool(r[4]), len(r) > 5 and bool(r[5]), plan.widths or ()
            )
            for r in state["rounds"]
        ]
        plan._starts = [r.start_slot for r in plan._rounds]
        plan.order = state.get("order")
        plan.progress = tuple(state.get("progress") or (0,) * world_size)
        return plan
