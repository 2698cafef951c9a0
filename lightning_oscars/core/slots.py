"""Which epoch batch a rank trains at each Lightning batch: the one source of its slots' decisions.

A :class:`SlotCursor` walks one pass over an epoch for the loader (``loader.py``), which only fetches and yields. It
reads the loader's current plan (which a re-plan rewrites mid-epoch), and in a deadline round asks the round's
pacer (``deadline.py``), or in the time-boxed warm-up the warm-up gate (``warmup.py``), whether the next step is
due, handing out the rank's reserved units in order while it is; a lockstep scheme may close a deadline round
(:meth:`SlotCursor.close_round`). Pure: no Lightning, no torch.distributed.

A rank's batch is a tuple of the loader's epoch batches (blocks of samples): one, unless per-rank batch sizes give
the plan widths (``partition.py``), when a step of ``w`` units takes, at each of its Lightning batches, that batch of
each of its units.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from lightning_oscars.core.deadline import DeadlinePacer
from lightning_oscars.core.partition import EpochPlan, Round
from lightning_oscars.core.warmup import WarmupGate

__all__ = ["Blocks", "SlotCursor", "SlotInfo", "SlotOwner", "ends_slot"]

Blocks = tuple[int, ...]  # the epoch batches one Lightning batch of a rank is made of


def ends_slot(batch_idx: int, batches_per_slot: int, epoch_batches: float) -> bool:
    """Whether batch ``batch_idx`` of the epoch is the last of its slot (a slot is ``batches_per_slot`` batches,
    the epoch's last one possibly fewer)."""
    return (batch_idx + 1) % batches_per_slot == 0 or batch_idx + 1 >= epoch_batches


@dataclass(frozen=True)
class SlotInfo:
    """What one yielded batch is: a real step or a no-op, how many samples it holds, the seconds spent
    fetching it (``None`` when that time is not a step's: the first batch after worker start-up), and the first slot
    of the round it belongs to (-1: before the epoch's plan)."""

    real: bool
    samples: int
    fetch_seconds: float | None = 0.0
    round_slot: int = -1


class SlotOwner(Protocol):
    """What a cursor reads of its loader (``LoadBalancedLoader``), live: the plan and pacing change between calls."""

    rank: int
    batches_per_slot: int
    num_batches: int
    widths: tuple[int, ...] | None
    plan: EpochPlan | None
    pacer: DeadlinePacer | None
    warmup_gate: WarmupGate | None


class SlotCursor:
    """One pass over an epoch's slots for one rank (see the module docstring)."""

    def __init__(self, owner: SlotOwner) -> None:
        self.owner = owner
        # The deadline round being fetched: its first slot, the units handed out so far, this slot's unit.
        self.round_slot = -1
        self.taken = 0
        self.slot_unit: int | None = None
        self.closed_round = -1  # a deadline round closed by a lockstep scheme (its first slot): no-ops from here
        self.stale = False  # units this rank did not reach in a deadline round are still queued for fetching
        # A slot decided before its fetch (decide_ahead): its position and decision.
        self.ahead: tuple[int, tuple[Blocks | None, int]] | None = None

    def decide(self, position: int, pending_real: int) -> tuple[Blocks | None, int]:
        """The epoch batch this rank trains at Lightning batch ``position`` (``None``: a no-op), and the first slot
        of the round it belongs to. ``pending_real``: real slots fetched and not yet run (the pacer counts them)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == position:
            return ahead[1]
        return self._decide(position, pending_real)

    def decide_ahead(self, position: int, round_slot: int) -> bool:
        """Whether the slot at ``position`` (the next to fetch) is a real step of round ``round_slot``, decided now,
        before its fetch; :meth:`decide` then returns this decision. Lightning fetches a sized loader's next batch only
        after the running batch's hooks, where a lockstep scheme must already say whether this rank steps again in
        the round. A slot of another round is not decided (a meeting may re-plan it first): ``False``."""
        if self.ahead is not None and self.ahead[0] == position:
            batch, decided_round = self.ahead[1]
            return batch is not None and decided_round == round_slot
        plan, bps = self.owner.plan, self.owner.batches_per_slot
        slot = position // bps
        if plan is None or position < 0 or slot >= plan.total_slots or plan.round_at(slot).start_slot != round_slot:
            return False
        if position % bps:  # within a slot: its unit was decided at its first batch
            return self.slot_unit is not None
        self.ahead = (position, self._decide(position, 0))
        return self.ahead[1][0] is not None

    def _decide(self, position: int, pending_real: int) -> tuple[Blocks | None, int]:
        owner = self.owner
        plan, bps = owner.plan, owner.batches_per_slot
        slot = position // bps
        rnd = plan.round_at(slot) if plan is not None and slot < plan.total_slots else None
        if rnd is not None and rnd.start_slot != self.round_slot and position % bps == 0:
            self._enter_round(rnd, slot)
        # Before the plan, only the epoch's first slot is fetched (see batch_at): the first round's.
        round_slot = rnd.start_slot if rnd is not None else (0 if plan is None else -1)
        if rnd is not None and rnd.deadline:
            return self._deadline_batch(position, rnd, pending_real), round_slot
        batch = self.batch_at(position)
        if position % bps == 0:
            # Kept in plain rounds too: a round's first slot is fetched before a re-plan may make it a deadline
            # round, whose other batches of that slot then follow this decision.
            self.taken += int(batch is not None)
            if plan is None:  # the first round's first slot: the plan's first round is entered already
                self.round_slot = 0
            self.slot_unit = None if batch is None else batch[0] // bps
        return batch, round_slot

    def close_round(self, round_slot: int, pending: deque[SlotInfo], position: int) -> deque[SlotInfo]:
        """Close the deadline round starting at ``round_slot`` (see ``LoadBalancedLoader.close_round``):
        ``pending`` (the infos yielded and not taken, the last of them at ``position`` - 1) with that round's
        real slots made no-ops, whose units are given back to the round's count of units handed out."""
        self.closed_round = round_slot
        bps = self.owner.batches_per_slot
        kept: deque[SlotInfo] = deque()
        first = position - len(pending)
        for k, info in enumerate(pending):
            if info.real and info.round_slot == round_slot:
                if (first + k) % bps == 0 and self.round_slot == round_slot:
                    self.taken -= 1  # the slot's unit was handed out at its first batch
                info = SlotInfo(False, 0, 0.0, round_slot)
            kept.append(info)
        if self.round_slot == round_slot:
            self.slot_unit = None  # the rest of a slot whose first batch was fetched is a no-op too
        if self.ahead is not None and self.ahead[1][1] == round_slot and self.ahead[1][0] is not None:
            self.taken -= 1  # decided ahead at its slot's first batch: its unit goes back too
            self.ahead = (self.ahead[0], (None, round_slot))
        return kept

    def batch_at(self, position: int) -> Blocks | None:
        """The epoch batches trained at Lightning batch ``position`` by this rank as the plan stands (plain rounds),
        or ``None`` for a no-op."""
        owner = self.owner
        plan = owner.plan
        slot, within = divmod(position, owner.batches_per_slot)
        units: Sequence[int] | None
        if plan is None:
            # Only the first batch of an epoch can be fetched before the strategy plans it, and a rank's
            # first units never depend on the plan (see partition.py): the first round's first units.
            widths = owner.widths or (1,) * (owner.rank + 1)
            first = sum(widths[: owner.rank])
            units = range(first, first + widths[owner.rank]) if slot == 0 else None
        elif slot >= plan.total_slots:
            units = None
        else:
            units = plan.units_at(owner.rank, slot)
        return self._blocks(units, within)

    def _blocks(self, units: Sequence[int] | None, within: int) -> Blocks | None:
        """Batch ``within`` of each unit in ``units`` (those the epoch has), or ``None`` if none."""
        if units is None:
            return None
        bps, count = self.owner.batches_per_slot, self.owner.num_batches
        blocks = tuple(b for b in (u * bps + within for u in units) if b < count)
        return blocks or None

    def _enter_round(self, rnd: Round, slot: int) -> None:
        """The first batch fetched of round ``rnd`` (at ``slot``: part-way in when resuming)."""
        plan = self.owner.plan
        assert plan is not None
        rank = self.owner.rank
        previous = plan.round_at(self.round_slot) if 0 <= self.round_slot < plan.total_slots else None
        if previous is not None and previous.deadline and self.taken < previous.quotas[rank]:
            self.stale = True  # the inner loader still holds the units this rank did not reach
        self.round_slot = rnd.start_slot
        self.taken = 0 if slot == rnd.start_slot else plan.progress[rank]

    def _deadline_batch(self, position: int, rnd: Round, pending_real: int) -> Blocks | None:
        """The epoch batch trained at ``position`` of deadline round ``rnd``, or ``None`` for a no-op: decided as
        the slot's first batch is fetched (the pacer), then the same unit for the slot's other batches."""
        owner = self.owner
        plan = owner.plan
        assert plan is not None
        slot, within = divmod(position, owner.batches_per_slot)
        if within == 0:
            reserved = rnd.quotas[owner.rank]
            pacer: DeadlinePacer | WarmupGate | None = owner.warmup_gate if rnd.warmup else owner.pacer
            due = (
                self.closed_round != rnd.start_slot
                and self.taken < reserved
                and (
                    pacer is None or pacer.is_due(slot - rnd.start_slot, rnd.length, self.taken, reserved, pending_real)
                )
            )
            self.slot_unit = plan.reserved_units(owner.rank, rnd)[self.taken] if due else None
            self.taken += int(due)
        return self._blocks(None if self.slot_unit is None else (self.slot_unit,), within)

    def upcoming_batches(self, position: int) -> list[Blocks]:
        """The epoch batches this rank will train from ``position`` on, as the plan stands: in a deadline round all
        the rank's reserved units not handed out yet (the current slot's included)."""
        owner = self.owner
        plan = owner.plan
        assert plan is not None
        bps = owner.batches_per_slot
        upcoming: list[Blocks] = []
        for rnd in plan.rounds:
            if rnd.end_slot * bps <= position:
                continue
            if not rnd.deadline:
                for at in range(max(position, rnd.start_slot * bps), rnd.end_slot * bps):
                    batch = self.batch_at(at)
                    if batch is not None:
                        upcoming.append(batch)
                continue
            units = plan.reserved_units(owner.rank, rnd)
            within = 0
            if rnd.start_slot == self.round_slot and rnd.start_slot * bps <= position:
                units = units[max(0, self.taken - 1) :]  # the current slot's unit was just handed out
                within = position % bps
            for k, unit in enumerate(units):
                for w in range(within if k == 0 else 0, bps):
                    if unit * bps + w < owner.num_batches:
                        upcoming.append((unit * bps + w,))
        return upcoming
