"""Synchronisation schemes: *when* ranks that train locally meet, and *how* their models are combined there.

A scheme is a :class:`SyncScheme`: a :class:`~lightning_oscars.policy.SchedulePolicy` (how many local steps
each rank takes per round) plus :meth:`SyncScheme.synchronize` (what happens at the round's end). The round
controller, the Lightning adapter, the loader and the strategy are the same for every scheme; a new way of
meeting (a parameter server, a partial all-reduce among a group) is a new subclass here or in its own module,
returned by the strategy's ``make_scheme``.

Shipped, all averaging the models with one all-reduce:

* :func:`adaptive_rounds`: oscars: per-rank local steps solved from measured speeds, re-solved on drift;
* :func:`fixed_period`: local SGD: ``period`` local steps on every rank;
* :func:`every_step`: averaging after every step (``fixed_period(1)``): ddp's trajectory for plain SGD;
* :class:`~lightning_oscars.outer.OuterNesterovAveraging`: averaging, then DiLoCo's outer Nesterov step on the
  averaged pseudo-gradient (``OscarsStrategy(outer_lr=...)``);
* :class:`~lightning_oscars.overlap.OverlappedAveraging`: a round's averaging overlaps the next round and reaches
  the models one round late (``OscarsStrategy(overlap_averaging=True)``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_oscars.averaging import FlatAverager
from lightning_oscars.policy import SchedulePolicy, Solver

__all__ = ["ModelAveraging", "SyncScheme", "adaptive_rounds", "every_step", "fixed_period"]


class SyncScheme(ABC):
    """How ranks that take local steps meet. ``policy`` decides the local steps; :meth:`synchronize` runs at every
    round's end (and before validation, a checkpoint and the end of fit), on every rank."""

    name = "scheme"
    # Whether a rank may wait for another inside a round (a staleness bound, a group exchange). Then no collective
    # may come between two of a round's steps on one rank unless this rank synchronized first (which releases whoever
    # waits for it): the session averages before a checkpoint's own collectives.
    waits_within_rounds = False

    def __init__(self, policy: SchedulePolicy) -> None:
        self.policy = policy

    @abstractmethod
    def synchronize(self, tensors: Sequence[Tensor], control: Sequence[float], weight_index: int) -> list[float]:
        """Combine ``tensors`` (the model, optimizer state, averaged copies: updated in place) with the other
        ranks' and return ``control`` summed over ranks. ``control[weight_index]`` is this rank's weight.
        Collective: every rank calls it with the same layout."""

    def synchronize_late(self, tensors: Sequence[Tensor], control: Sequence[float], weight_index: int) -> list[float]:
        """Like :meth:`synchronize` at a round's end where nothing needs the models equal: the combination may
        reach ``tensors`` at the next call (overlapped with the next round), the summed control is returned now. By
        default it is :meth:`synchronize`."""
        return self.synchronize(tensors, control, weight_index)

    @property
    def settled(self) -> bool:
        """Whether the tensors hold the last combination (``False`` while a late one is still to be applied; the
        same answer on every rank)."""
        return True

    def release(self) -> None:  # noqa: B027 - optional: most schemes hold nothing between fits
        """Drop buffers held between rounds (the end of a fit)."""

    def after_step(self) -> None:  # noqa: B027 - optional: most schemes only act at a round's end
        """This rank just took a real optimizer step (a parameter server pushes it here). Not collective: ranks
        take different numbers of steps."""

    def bind(self, parameters: Iterable[Tensor]) -> None:  # noqa: B027 - optional
        """The module's trainable parameters, told once per fit before the first round (a scheme that treats
        them apart from buffers and optimizer state keeps them)."""

    def state_dict(self) -> dict[str, Any]:
        """State the scheme carries across rounds, saved in checkpoints (none by default)."""
        return {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:  # noqa: B027 - optional
        """Resume :meth:`state_dict` (called when a checkpoint is restored, before the first round)."""


class ModelAveraging(SyncScheme):
    """Weighted mean of every rank's tensors, control data in the same buffer: one all-reduce per round."""

    name = "model_averaging"

    def __init__(self, policy: SchedulePolicy, device: torch.device | str = "cpu", group: Any = None) -> None:
        super().__init__(policy)
        self.device = torch.device(device)
        self.group = group
        self._averager: FlatAverager | None = None

    def synchronize(self, tensors: Sequence[Tensor], control: Sequence[float], weight_index: int) -> list[float]:
        averager = self._averager
        # Rebuilt when the set of tensors changes (a parameter gets its first optimizer state; LBFGS replaces its
        # state tensors).
        if averager is None or not averager.holds(tensors) or averager.control_size != len(control):
            averager = self._averager = FlatAverager(tensors, len(control), self.device)
        return averager.all_reduce(control[weight_index], control, weight_index, group=self.group)

    def release(self) -> None:
        self._averager = None


def adaptive_rounds(solver: Solver = "exact", device: torch.device | str = "cpu", **options: Any) -> ModelAveraging:
    """Oscars: local steps solved per rank from measured step times (``options``: see :class:`SchedulePolicy`)."""
    if solver == "uniform":
        raise ValueError("adaptive_rounds needs a solver ('exact' or 'alg1'); use fixed_period for local SGD")
    return ModelAveraging(SchedulePolicy(solver, **options), device)


def fixed_period(period: int, device: torch.device | str = "cpu", **options: Any) -> ModelAveraging:
    """Local SGD: ``period`` local steps on every rank, then an averaging."""
    return ModelAveraging(SchedulePolicy("uniform", max_local_steps=period, **options), device)


def every_step(device: torch.device | str = "cpu", **options: Any) -> ModelAveraging:
    """Average after every optimizer step: the models never diverge (ddp's trajectory for plain SGD)."""
    return fixed_period(1, device, **options)
