"""The two callbacks through which Lightning's loop drives the strategy's rounds.

A strategy gets no epoch hooks and no batch-end hook from Lightning, so ``OscarsStrategy.setup`` inserts these
callbacks at fixed positions in ``trainer.callbacks``; their order is part of the design (see each class).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from typing_extensions import override

from lightning_oscars.monitor import ScheduleMonitor

if TYPE_CHECKING:
    from lightning_oscars.strategy import OscarsStrategy

__all__ = ["EpochCallback", "RoundCallback", "append_round_callbacks", "has_round_callbacks", "insert_round_callbacks"]


class EpochCallback(Callback):
    """Runs before every other callback: sizes each epoch to its plan before anything (progress bars) reads its
    length, and does the epoch end's collectives (metric alignment, averaging) before anything else can issue one.
    Lightning's progress bar computes the epoch's ``sync_dist`` values on rank 0 alone in its own
    ``on_train_epoch_end``, and the other ranks match those reductions later; a collective of ours in between would
    pair with them and hang."""

    def __init__(self, strategy: OscarsStrategy) -> None:
        self.strategy = strategy

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.driver.begin_rounds(trainer)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.driver.prepare_epoch(trainer)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.strategy.is_active:
            self.strategy.driver.align_epoch_metrics(trainer)
        self.strategy.average_if_pending()


class RoundCallback(Callback):
    """Ends rounds and averages before validation and at the end of fit. It runs after the user's callbacks (their
    time counts as step time) and before checkpoint callbacks (which must save the averaged model)."""

    def __init__(self, strategy: OscarsStrategy) -> None:
        self.strategy = strategy
        self._validation_started: float | None = None

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        self.strategy.driver.finish_slot(trainer, kwargs.get("batch_idx", args[-1] if args else 0))

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.average_if_pending()
        if not trainer.sanity_checking and self.strategy._fitting(trainer):
            # ModelCheckpoint / EarlyStopping at the validation's end may monitor a training step value
            self.strategy.driver.agree_step_values(trainer)
        self._validation_started = time.perf_counter()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        started, self._validation_started = self._validation_started, None
        if started is not None and self.strategy.is_active:  # records count training time only
            self.strategy.rounds.exclude_time(time.perf_counter() - started)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.average_if_pending()
        self.strategy.end_tuner_run()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Runs before checkpoint callbacks' on_exception, so that a failing rank saves without collectives.
        self.strategy.report_failure(exception)


def insert_round_callbacks(strategy: OscarsStrategy, callbacks: list[Callback], monitor: bool) -> None:
    """Put the epoch callback first and the round callback (then a ``ScheduleMonitor`` if asked and none is there)
    before the first checkpoint callback; callbacks of an earlier fit on the same Trainer are replaced."""
    extra = ScheduleMonitor() if monitor and not any(isinstance(cb, ScheduleMonitor) for cb in callbacks) else None
    callbacks[:] = [cb for cb in callbacks if not isinstance(cb, (EpochCallback, RoundCallback))]
    callbacks.insert(0, EpochCallback(strategy))
    position = next((i for i, cb in enumerate(callbacks) if isinstance(cb, Checkpoint)), len(callbacks))
    callbacks.insert(position, RoundCallback(strategy))
    if extra is not None:
        callbacks.insert(position + 1, extra)


def has_round_callbacks(callbacks: list[Callback]) -> bool:
    """Whether ``callbacks`` holds the epoch and round callbacks (a tuner may have replaced the list)."""
    kinds = {type(cb) for cb in callbacks}
    return EpochCallback in kinds and RoundCallback in kinds


def append_round_callbacks(strategy: OscarsStrategy, callbacks: list[Callback]) -> None:
    """Put the epoch and round callbacks after a tuner's own (Lightning's LR finder reads its callback by position)."""
    callbacks.extend([EpochCallback(strategy), RoundCallback(strategy)])
