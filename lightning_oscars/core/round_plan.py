"""One round of an epoch's plan: its slots, each rank's quota of units, and which units each rank trains in it.

Vocabulary as in ``partition.py``, which lays rounds out: a round takes the next ``sum(quotas)`` units, first the
units of every training rank's first step, in rank order, then the rest of every rank's units, rank after rank. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_oscars.core.quotas import steps_of

__all__ = ["Round"]


@dataclass(frozen=True)
class Round:
    """One round: ``length`` slots from ``start_slot``; rank ``i`` trains ``quotas[i]`` units from position
    ``first_unit``. In a ``deadline`` round the quotas are reservations until :meth:`EpochPlan.settle` replaces
    them by what each rank trained; a ``warmup`` round is a deadline round whose slots the warm-up gate decides.
    ``widths``: units per step of each rank (empty: one)."""

    start_slot: int
    length: int
    quotas: tuple[int, ...]
    first_unit: int
    deadline: bool = False
    warmup: bool = False
    widths: tuple[int, ...] = ()

    def width(self, rank: int) -> int:
        return self.widths[rank] if self.widths else 1

    def steps(self, rank: int) -> int:
        """The real steps of ``rank`` in this round."""
        return steps_of(self.quotas[rank], self.width(rank))

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
        steps = self.steps(rank)
        return [k * self.length // steps for k in range(steps)]

    def units_of(self, rank: int) -> list[int]:
        """The units rank ``rank`` trains on, in order: one per slot of :meth:`real_offsets`, or with widths
        :meth:`step_units`' runs one after the other."""
        if self.quotas[rank] == 0:
            return []
        starts = [min(q, self.width(r)) for r, q in enumerate(self.quotas)]
        first = self.first_unit + sum(starts[:rank])
        rest = self.first_unit + sum(starts) + sum(q - s for q, s in zip(self.quotas[:rank], starts[:rank]))
        return [*range(first, first + starts[rank]), *range(rest, rest + self.quotas[rank] - starts[rank])]

    def step_units(self, rank: int) -> list[list[int]]:
        """The units of each of ``rank``'s real steps, in order (one unit each without widths)."""
        units, width = self.units_of(rank), self.width(rank)
        return [units[k : k + width] for k in range(0, len(units), width)]

    def units_through(self, rank: int, steps: int) -> list[int]:
        """The units of ``rank``'s first ``steps`` real steps."""
        return [p for run in self.step_units(rank)[:steps] for p in run]
