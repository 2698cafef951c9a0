"""What the round logic needs to know of the trainer to plan an epoch, as plain values.

:class:`EpochShape` is read from Lightning's counters once, as the epoch is planned (the glue reads them, the core
plans from the value): the epoch, the batches per optimizer step, the batch limit, how many training loaders, and
where the epoch validates. :class:`EpochValidation` is the last: where Lightning validates in this epoch, by a count of
its own batches, and where it will once a re-solved schedule re-sizes the running epoch (the round plan ends rounds
there). The glue tells it what Lightning was told (:meth:`EpochValidation.sized`, :meth:`EpochValidation.resized`)
and which batch is ending (:meth:`EpochValidation.at_batch`); it never asks the glue back. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["EpochShape", "EpochValidation", "validations_after_resize"]


def validations_after_resize(done: int, new_batches: int, due: int) -> tuple[int, ...]:
    """The batch counts (1-based) at which an epoch re-sized to ``new_batches`` batches, after ``done`` of them passed
    their validation check, runs the ``due`` validations it still owed.

    Evenly spaced over the rest of the epoch, the last at its end (an interval of the new length rarely fits: with
    130 batches left after 40, no divisor of the length validates exactly twice). Fewer when fewer batches are left."""
    left = new_batches - done
    due = min(due, left)
    return tuple(done + -(-k * left // due) for k in range(1, due + 1)) if due > 0 else ()


class EpochValidation:
    """Where one epoch validates, as Lightning decides it (``(batch_idx + 1) % val_check_batch == 0``) from
    ``val_check_interval`` (a fraction of the epoch, or a batch count), and after a mid-epoch re-size at the batches
    :func:`validations_after_resize` spreads the owed ones over."""

    def __init__(self, interval: int | float, batches_per_slot: int, cuts_rounds: bool = True) -> None:
        self.interval = interval
        self.batches_per_slot = batches_per_slot
        # Whether the plan ends rounds where it validates: not when the epoch does not validate at all, or is cut at a
        # batch count of its own (an int limit_train_batches); a re-size still paces the validations owed.
        self.cuts_rounds = cuts_rounds
        self.length: int | None = None  # the epoch's length Lightning was told (None: not yet, this epoch)
        self.points: frozenset[int] | None = None  # where it validates after a mid-epoch re-size
        self.done = 0  # batches past their validation check (the index of the batch now ending)

    def at_batch(self, batch_idx: int) -> None:
        """The batch ``batch_idx`` (0-based) is ending, before its validation check."""
        self.done = batch_idx

    def sized(self, length: int) -> None:
        """Lightning was told the epoch has ``length`` batches, from its start."""
        self.length, self.points = length, None

    def resized(self, length: int) -> frozenset[int] | None:
        """Lightning was told, at the end of batch :attr:`done`, that the running epoch now has ``length`` batches:
        where the rest of the epoch validates (``None``: as an epoch of that length would).

        A batch count (an int ``val_check_interval``) means every that many batches whatever the epoch's length, as
        under ddp: a re-size keeps that rule. A fraction of the epoch spreads the validations still owed."""
        if not isinstance(self.interval, float):
            self.length, self.points = length, None
            return None
        due = self.due(self.done)
        self.length = length
        self.points = None if due is None else frozenset(validations_after_resize(self.done, length, due))
        return self.points

    def check_every(self, batches: int) -> int:
        """Lightning's ``val_check_batch`` for an epoch of ``batches`` batches."""
        return max(1, int(batches * self.interval)) if isinstance(self.interval, float) else int(self.interval)

    def due(self, done: int) -> int | None:
        """How many validations the epoch holds after its first ``done`` batches (``None`` before it was sized)."""
        if self.points is not None:
            return sum(point > done for point in self.points)
        if self.length is None:
            return None
        return self.length // self.check_every(self.length) - done // self.check_every(self.length)

    def validates_after(self, batch_idx: int) -> bool | None:
        """Whether the epoch validates at the end of batch ``batch_idx`` (``None``: Lightning's own rule holds)."""
        return None if self.points is None else batch_idx + 1 in self.points

    def slots(self, slots: int) -> tuple[int, ...]:
        """The slot counts after which an epoch of ``slots`` slots validates, its end left out: where the round plan
        ends rounds (``EpochPlan.boundaries``)."""
        batches = slots * self.batches_per_slot
        if isinstance(self.interval, float) and self.length is not None and batches != self.length:
            # a re-plan re-sizes the running epoch: where resized() will have it validate
            due = self.due(self.done)
            if due is not None:
                return self._slots_of(validations_after_resize(self.done, batches, due), slots)
        if self.points is not None:
            return self._slots_of(self.points, slots)
        check = self.check_every(batches)
        return self._slots_of(range(check, batches + 1, check), slots)

    def _slots_of(self, batches: Iterable[int], slots: int) -> tuple[int, ...]:
        return tuple(sorted({-(-b // self.batches_per_slot) for b in batches} & set(range(1, slots))))


@dataclass(frozen=True)
class EpochShape:
    """Lightning's counters for one epoch, read once as it is planned."""

    epoch: int
    batches_per_slot: int  # accumulate_grad_batches in force this epoch: one optimizer step per slot
    limit: int | float  # limit_train_batches (a fraction is applied to the units, as ddp would train)
    loaders: int  # training DataLoaders (one is split by speed)
    validation: EpochValidation | None  # None: the epoch does not validate by a count of batches

    @property
    def boundaries(self) -> Callable[[int], tuple[int, ...]] | None:
        """Where the round plan ends rounds, as a function of the epoch's slots (``None``: nowhere inside it)."""
        validation = self.validation
        return validation.slots if validation is not None and validation.cuts_rounds else None
