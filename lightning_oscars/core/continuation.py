"""Going on with an epoch after a failed round, on the ranks that are left (pure: no Lightning, no torch.distributed).

When a round's averaging fails (a peer died), every surviving rank has trained its share of that round into its own
model, and the lost ranks' shares are gone with them. The restarted job merges the survivors' models, so what the
epoch has *consumed* is exactly:

* every unit of the rounds before the failed one (they are in the models averaged at that round's start);
* in the failed round, what each survivor trained, and what a lost rank had trained up to an extra averaging inside
  the round (before a validation or a checkpoint: that work reached every model then);

and everything else of the epoch is still to be trained, the lost ranks' units of the failed round included (they
are trained again, by whoever is there now). :func:`continue_epoch` works this out from the failed world's plan;
:class:`EpochContinuation` is what the new world's plan starts from (``EpochPlan(..., continuation=...)``): its order
of units puts the consumed ones first, and the slots already run stay behind it as one finished round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["EpochContinuation", "FailedPlan", "Survivor", "continue_epoch"]


class FailedPlan(Protocol):
    """What :func:`continue_epoch` reads of the failed world's plan (a ``partition.EpochPlan``, which itself takes an
    :class:`EpochContinuation`: hence a protocol, not an import)."""

    world_size: int
    total_units: int
    total_slots: int
    progress: tuple[int, ...]

    def round_at(self, slot: int) -> Any: ...

    def unit(self, position: int) -> int: ...


@dataclass(frozen=True)
class Survivor:
    """A rank (with replica groups, a replica) whose model outlived the failed round.

    Args:
        rank: its rank in the failed world.
        round_units: the steps it trained in the failed round, from the round's start (a unit each without widths).
    """

    rank: int
    round_units: int


@dataclass(frozen=True)
class EpochContinuation:
    """Where the epoch goes on: its first ``slots`` slots are done and trained ``order[:consumed]``.

    Attributes:
        epoch: the epoch it continues.
        order: every unit of the epoch once: the consumed ones first, then the rest in the epoch's order.
        consumed: how many units the merged models have trained.
        slots: the slots of the epoch already run (Lightning resumes after them).
        retrained: the units of the failed round a lost rank held after the last averaging it took part in: trained
            again (the work lost is at most these: the rank may have died before training them all).
    """

    epoch: int
    order: tuple[int, ...]
    consumed: int
    slots: int
    retrained: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if sorted(self.order) != list(range(len(self.order))):
            raise ValueError("a continuation's order must hold every unit of the epoch once")
        if not 0 <= self.consumed <= len(self.order) or self.slots < 0:
            raise ValueError(f"consumed {self.consumed} of {len(self.order)} units in {self.slots} slots")

    def fits(self, epoch: int, total_units: int) -> bool:
        """Whether it continues ``epoch`` of ``total_units`` units (else the epoch is planned afresh)."""
        return epoch == self.epoch and total_units == len(self.order)

    def slot_bound(self, bound_of: Callable[[int], int]) -> int:
        """The most slots the continued epoch can take: those run, then the most the units left can take
        (``bound_of(units)``); more than a whole epoch's bound when the failed round came late in it."""
        return self.slots + bound_of(len(self.order) - self.consumed)

    def left(self, bound: int) -> tuple[int, int]:
        """The units still to train, and the slots left of an epoch of at most ``bound`` slots."""
        return len(self.order) - self.consumed, max(0, bound - self.slots)


def continue_epoch(
    plan: FailedPlan, epoch: int, slots: int, survivors: Sequence[Survivor], averaged: bool = False
) -> EpochContinuation:
    """What ``epoch`` (planned by ``plan``) consumed when its averaging after ``slots`` slots failed with only
    ``survivors`` left (see the module docstring). ``plan.progress`` holds what every rank had trained in the failed
    round at the last extra averaging inside it. ``averaged``: the averaging after ``slots`` did happen and nothing
    trained since (a coordinated stop at a round boundary; a failure inside a validation or a checkpoint write, after
    their averaging): every unit of the rounds before is consumed, the current round's up to ``plan.progress``."""
    if not survivors:
        raise ValueError("no rank survived the failed round: there is nothing to go on from")
    trained = {s.rank: s.round_units for s in survivors}
    if len(trained) != len(survivors) or not all(0 <= r < plan.world_size for r in trained):
        raise ValueError(f"survivors {sorted(trained)} are not distinct ranks of {plan.world_size}")
    positions: list[int] = []
    retrained: list[int] = []
    if averaged and slots >= plan.total_slots:
        positions = list(range(plan.total_units))
    elif averaged:
        current = plan.round_at(slots)  # at a round boundary its progress is zero: nothing of it was trained
        positions = list(range(current.first_unit))
        for rank in range(plan.world_size):
            positions += current.units_through(rank, _averaged_progress(plan, rank))
    elif slots > 0:
        failed = plan.round_at(min(slots, plan.total_slots) - 1)
        positions = list(range(failed.first_unit))
        for rank in range(plan.world_size):
            steps = failed.steps(rank)
            done = trained.get(rank, _averaged_progress(plan, rank))
            if not 0 <= done <= steps:
                raise ValueError(f"rank {rank} trained {done} steps of a round that gave it {steps}")
            positions += failed.units_through(rank, done)
            if rank not in trained:  # a lost rank's work after the last extra averaging is gone with it
                kept = len(failed.units_through(rank, _averaged_progress(plan, rank)))
                retrained += [plan.unit(p) for p in failed.units_of(rank)[kept:]]
    consumed = [plan.unit(p) for p in positions]
    taken = set(positions)
    rest = [plan.unit(p) for p in range(plan.total_units) if p not in taken]
    return EpochContinuation(epoch, tuple(consumed + rest), len(consumed), slots, tuple(retrained))


def _averaged_progress(plan: FailedPlan, rank: int) -> int:
    """The steps ``rank`` had trained in the current round at its last extra averaging (0 if none)."""
    return plan.progress[rank] if rank < len(plan.progress) else 0
