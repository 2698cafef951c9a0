"""The two callbacks through which Lightning's loop drives a fit's rounds.

A strategy gets no epoch hooks and no batch-end hook from Lightning, so a fit session (``session.py``) inserts these
callbacks at fixed positions in ``trainer.callbacks`` when the fit is set up and removes them when it is torn down;
their order is part of the design (see each class). They hold the session's :class:`RoundEvents`, never the
strategy.
"""

from __future__ import annotations

from typing import Any, Protocol

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from typing_extensions import override

from lightning_oscars.lightning.monitor import ScheduleMonitor

__all__ = [
    "EpochCallback",
    "RoundCallback",
    "RoundEvents",
    "append_round_callbacks",
    "insert_round_callbacks",
    "without_callbacks",
]


class RoundEvents(Protocol):
    """What the callbacks tell a fit's session (``session.FitSession``), in Lightning's order."""

    def begin_rounds(self, trainer: Trainer) -> None: ...
    def prepare_epoch(self, trainer: Trainer) -> None: ...
    def end_epoch(self, trainer: Trainer) -> None: ...
    def start_step(self) -> None: ...
    def finish_slot(self, trainer: Trainer, batch_idx: int) -> None: ...
    def start_validation(self, trainer: Trainer) -> None: ...
    def end_validation(self, trainer: Trainer) -> None: ...
    def end_training(self, trainer: Trainer) -> None: ...
    def report_failure(self, error: BaseException) -> None: ...


class EpochCallback(Callback):
    """Runs before every other callback: sizes each epoch to its plan before anything (progress bars) reads its
    length, and does the epoch end's collectives (metric alignment, averaging) before anything else can issue one.
    Lightning's progress bar computes the epoch's ``sync_dist`` values on rank 0 alone in its own
    ``on_train_epoch_end``, and the other ranks match those reductions later; a collective of ours in between would
    pair with them and hang."""

    def __init__(self, events: RoundEvents) -> None:
        self.events = events

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.events.begin_rounds(trainer)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.events.prepare_epoch(trainer)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        self.events.start_step()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.events.end_epoch(trainer)


class RoundCallback(Callback):
    """Ends rounds and averages before validation and at the end of fit. It runs after the user's callbacks (their
    time counts as step time) and before checkpoint callbacks (which must save the averaged model)."""

    def __init__(self, events: RoundEvents) -> None:
        self.events = events

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        self.events.finish_slot(trainer, kwargs.get("batch_idx", args[-1] if args else 0))

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.events.start_validation(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.events.end_validation(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.events.end_training(trainer)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Runs before checkpoint callbacks' on_exception, so that a failing rank saves without collectives.
        self.events.report_failure(exception)


def insert_round_callbacks(events: RoundEvents, callbacks: list[Callback], monitor: bool) -> list[Callback]:
    """Put the epoch callback first and the round callback (then a ``ScheduleMonitor`` if asked and none is there)
    before the first checkpoint callback; returns the round callbacks it inserted (the caller removes them)."""
    extra = ScheduleMonitor() if monitor and not any(isinstance(cb, ScheduleMonitor) for cb in callbacks) else None
    ours: list[Callback] = [EpochCallback(events), RoundCallback(events)]
    callbacks.insert(0, ours[0])
    position = next((i for i, cb in enumerate(callbacks) if isinstance(cb, Checkpoint)), len(callbacks))
    callbacks.insert(position, ours[1])
    if extra is not None:
        # The monitor stays after the fit: it is the user's view of it (its summary, its records).
        callbacks.insert(position + 1, extra)
    return ours


def append_round_callbacks(events: RoundEvents, callbacks: list[Callback]) -> list[Callback]:
    """Put the epoch and round callbacks after a tuner's own (Lightning's LR finder reads its callback by position);
    returns them."""
    ours: list[Callback] = [EpochCallback(events), RoundCallback(events)]
    callbacks.extend(ours)
    return ours


def without_callbacks(callbacks: list[Callback], ours: list[Callback]) -> list[Callback]:
    """``callbacks`` without ``ours`` (by identity), as a new list: Lightning may be iterating over the old one (a
    tuner's loop run ends inside its ``on_train_end``)."""
    mine = {id(cb) for cb in ours}
    return [cb for cb in callbacks if id(cb) not in mine]
