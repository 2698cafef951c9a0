"""Synchronisation schemes: *how* the models of ranks that train locally are combined where they meet.

When ranks meet is the round controller's (``rounds.py``, with its ``SchedulePolicy``); what a meeting's control
data says (step times, samples, requests) is the fit session's: it hands a scheme the round's
:class:`RoundMeeting`. A scheme (:class:`SyncScheme`) only combines models, in :meth:`SyncScheme.combine`. It may
carry the meeting's control data in its own collective (:meth:`RoundMeeting.deliver`, as :class:`ModelAveraging`
does: one all-reduce per round); if it does not, the session sums the control data itself in one small all-reduce.

Shipped:

* :class:`ModelAveraging`: the weighted mean of every rank's tensors, the control data in the same buffer (oscars,
  local SGD);
* :class:`~lightning_oscars.dist.outer.OuterNesterovAveraging`: averaging, then DiLoCo's outer Nesterov step on the
  averaged pseudo-gradient (``OscarsStrategy(outer_lr=...)``);
* :class:`~lightning_oscars.dist.overlap.OverlappedAveraging`: a round's averaging overlaps the next round and reaches
  the models one round late (``OscarsStrategy(overlap_averaging=True)``);
* :class:`~lightning_oscars.dist.server_scheme.ParameterServerScheme` and :class:`~lightning_oscars.dist.ripples.RipplesScheme`:
  the paradigms, which also act after every step (:meth:`SyncScheme.after_step`).

A new scheme is a subclass in a module of its own, returned by a strategy's ``make_scheme`` (see
``docs/adding-a-scheme.md`` and ``tests/gossip_fixture.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_oscars.dist.averaging import FlatAverager

if TYPE_CHECKING:
    from lightning_oscars.core.loader import LoadBalancedLoader
    from lightning_oscars.core.rounds import RoundController

__all__ = ["ModelAveraging", "RoundMeeting", "SyncScheme"]


class RoundMeeting:
    """One meeting's control data, owned by the fit session and lent to the scheme while it combines the models.

    Args:
        control: this rank's control vector (``ControlData``'s wire format; opaque to a scheme).
        weight_index: where in ``control`` this rank's averaging weight sits.
        sum_control: sums a control vector over ranks (one small all-reduce): the session's, used when the scheme
            carried the control data in no collective of its own.
        device: where this rank's collectives run (the strategy's root device).
    """

    def __init__(
        self,
        control: Sequence[float],
        weight_index: int,
        sum_control: Callable[[Sequence[float]], list[float]],
        device: torch.device | str = "cpu",
    ) -> None:
        self.control = list(control)
        self.weight_index = weight_index
        self.device = torch.device(device)
        self._sum_control = sum_control
        self._summed: list[float] | None = None

    @property
    def weight(self) -> float:
        """This rank's weight in the mean (1, or its samples under ``averaging="samples"``)."""
        return self.control[self.weight_index]

    def deliver(self, summed: Sequence[float]) -> None:
        """The scheme's own collective carried the control data: here is its sum over ranks."""
        self._summed = list(summed)

    def sum_now(self) -> list[float]:
        """Sum the control data now, in its own small all-reduce (a scheme that posts its model exchange and must not
        make the control data wait behind it)."""
        if self._summed is None:
            self._summed = self._sum_control(self.control)
        return self._summed

    def summed(self) -> list[float]:
        """The control data summed over ranks (summed now if the scheme did not carry it)."""
        return self.sum_now()


class SyncScheme(ABC):
    """How the models of ranks that take local steps are combined at a meeting (every round's end, and before
    validation, a checkpoint and the end of fit), on every rank."""

    name = "scheme"
    # Whether a rank may wait for another inside a round (a staleness bound, a group exchange). Then no collective
    # may come between two of a round's steps on one rank unless this rank synchronized first (which releases whoever
    # waits for it): the session averages before a checkpoint's own collectives.
    waits_within_rounds = False

    @abstractmethod
    def combine(self, tensors: Sequence[Tensor], meeting: RoundMeeting) -> None:
        """Combine ``tensors`` (the model, optimizer state, averaged copies: updated in place) with the other ranks'.
        Collective: every rank calls it with the same layout. May carry ``meeting``'s control data
        (:meth:`RoundMeeting.deliver`)."""

    def combine_late(self, tensors: Sequence[Tensor], meeting: RoundMeeting) -> None:
        """Like :meth:`combine` at a round's end where nothing needs the models equal: the combination may reach
        ``tensors`` at the next call (overlapped with the next round). By default it is :meth:`combine`."""
        self.combine(tensors, meeting)

    @property
    def settled(self) -> bool:
        """Whether the tensors hold the last combination (``False`` while a late one is still to be applied; the
        same answer on every rank)."""
        return True

    def shape_rounds(self, rounds: RoundController) -> None:  # noqa: B027 - optional
        """Adjust the fit's round controller before its first round (a staleness bound limits the step spread)."""

    def adopt_loader(self, loader: LoadBalancedLoader) -> None:  # noqa: B027 - optional
        """The fit's load-balanced loader (a lockstep scheme closes its rounds)."""

    def bind(self, parameters: Iterable[Tensor]) -> None:  # noqa: B027 - optional
        """The module's trainable parameters, told once per fit before the first round (collective: every rank; a
        scheme may make its process groups here)."""

    def after_step(self) -> None:  # noqa: B027 - optional: most schemes only act at a round's end
        """This rank just took a real optimizer step (a parameter server pushes it here). Not collective: ranks
        take different numbers of steps."""

    def abandon(self) -> None:  # noqa: B027 - optional: only schemes that exchange within rounds need it
        """This rank exchanges nothing more with the others in this fit (a peer is lost, or the fit failed): release
        whoever waits for this rank, and wait for nobody when released. Not collective."""

    def release(self) -> None:  # noqa: B027 - optional: most schemes hold nothing between fits
        """The fit ended: drop buffers, stop threads, retire process groups."""

    def state_dict(self) -> dict[str, Any]:
        """State the scheme carries across rounds, saved in checkpoints (none by default)."""
        return {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:  # noqa: B027 - optional
        """Resume :meth:`state_dict` (called when a checkpoint is restored, before the first round)."""


class ModelAveraging(SyncScheme):
    """Weighted mean of every rank's tensors, the meeting's control data in the same buffer: one all-reduce.

    Args:
        device: where the flat buffer lives and the all-reduce runs (by default the meeting's device).
        group: the process group (by default every rank).
    """

    name = "model_averaging"

    def __init__(self, device: torch.device | str | None = None, group: Any = None) -> None:
        self.device = None if device is None else torch.device(device)
        self.group = group
        self._averager: FlatAverager | None = None

    def average(self, tensors: Sequence[Tensor], meeting: RoundMeeting) -> None:
        """The weighted mean of ``tensors`` over ranks, in place; the control data rides along."""
        averager = self._averager
        control = meeting.control
        # Rebuilt when the set of tensors changes (a parameter gets its first optimizer state; LBFGS replaces its
        # state tensors).
        if averager is None or not averager.holds(tensors) or averager.control_size != len(control):
            averager = self._averager = FlatAverager(tensors, len(control), self.device or meeting.device)
        meeting.deliver(averager.all_reduce(meeting.weight, control, meeting.weight_index, group=self.group))

    def combine(self, tensors: Sequence[Tensor], meeting: RoundMeeting) -> None:
        self.average(tensors, meeting)

    def release(self) -> None:
        self._averager = None
