"""The training epoch loop under oscars: its length, where it validates, and the collectives it makes per batch.

The epoch's length is the plan's (Lightning is told it at the epoch's start and again when a re-solved schedule
re-sizes the running epoch: ``max_batches``, ``val_check_batch``, the tqdm total). Where it validates is read once, as
an :class:`~lightning_oscars.core.epoch_shape.EpochValidation` the round plan cuts rounds at. The per-batch collectives
become no-ops: the SIGTERM broadcast and step-interval ``Timer`` checks travel in the round's all-reduce instead, and
``ThroughputMonitor`` counts this rank's real slots only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ThroughputMonitor, Timer

from lightning_oscars.core.epoch_shape import EpochShape, EpochValidation
from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.patches import Patches

__all__ = ["EpochLength", "epoch_validation"]


def epoch_validation(trainer: Trainer, batches_per_slot: int) -> EpochValidation | None:
    """Where the current epoch validates by a count of batches (``None``: by time, or by a count over the whole fit).
    It cuts rounds when the epoch validates at all and is not cut at an int ``limit_train_batches``."""
    every, interval = trainer.check_val_every_n_epoch, trainer.val_check_interval
    if every is None or internals.time_based_validation(trainer) or isinstance(interval, bool):
        return None
    if not isinstance(interval, (int, float)):
        return None
    cuts_rounds = (
        (trainer.current_epoch + 1) % every == 0
        and trainer.enable_validation
        and not isinstance(trainer.limit_train_batches, int)  # the epoch is cut at a batch count, not at its plan's end
    )
    return EpochValidation(interval, batches_per_slot, cuts_rounds=cuts_rounds)


class EpochLength:
    """One fit's epochs as Lightning runs them. ``slot_is_real``: whether the batch in progress is a real step."""

    def __init__(self, slot_is_real: Callable[[], bool]) -> None:
        self._slot_is_real = slot_is_real
        self._timers: list[Timer] = []
        self.validation: EpochValidation | None = None  # the current epoch's

    def install(self, trainer: Trainer, patches: Patches) -> None:
        owner, name = internals.sigterm_broadcast(trainer)
        patches.replace(owner, name, lambda: None)
        callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
        self._timers = internals.step_timers(callbacks)
        for timer in self._timers:
            patches.replace(timer, "on_train_batch_end", _skip)
        for callback in callbacks:
            if isinstance(callback, ThroughputMonitor):
                # It measures this rank's throughput and needs its sample count to grow at every batch.
                patches.replace(callback, "on_train_batch_end", self._on_real_slots(callback.on_train_batch_end))

    def forget(self) -> None:
        self._timers = []

    def timer_expired(self) -> bool:
        return internals.timer_expired(self._timers)

    def read_shape(self, trainer: Trainer) -> EpochShape:
        """Lightning's counters for the epoch about to be planned (its validation read afresh)."""
        epoch = trainer.current_epoch
        batches_per_slot = internals.accumulation_at(trainer, epoch)
        self.validation = epoch_validation(trainer, batches_per_slot)
        loaders = internals.training_loader_count(trainer)
        return EpochShape(epoch, batches_per_slot, trainer.limit_train_batches, loaders, self.validation)

    def size(self, trainer: Trainer, batches: int, mid_epoch: bool = False) -> None:
        """Tell Lightning the epoch has ``batches`` batches (a fractional ``limit_train_batches`` is already in the
        plan: the session plans the units ddp would train under it; an int one caps the batches, as Lightning counts
        them on every rank); ``mid_epoch``: re-sized at a batch's end, before that batch's validation check, and the
        rest of the epoch still runs the validations it owed (see :meth:`pace_validation`)."""
        limit = trainer.limit_train_batches
        trainer.fit_loop.max_batches = min(batches, limit) if isinstance(limit, int) else batches if limit else 0
        length = trainer.num_training_batches
        if self.validation is not None and isinstance(length, int):
            if mid_epoch:
                self.validation.resized(length)
            else:
                self.validation.sized(length)
        if isinstance(trainer.val_check_interval, float):
            trainer.val_check_batch = max(1, int(length * trainer.val_check_interval))
        try:
            bar = trainer.progress_bar_callback.train_progress_bar  # type: ignore[union-attr]
        except (AttributeError, TypeError):  # no bar, not tqdm, or not created yet
            bar = None
        if bar is not None and getattr(bar, "total", None) is not None:
            bar.total = length  # tqdm: the epoch got shorter once speeds were known

    def pace_validation(self, trainer: Trainer, batch_idx: int) -> None:
        """At a batch's end, before Lightning's validation check: after a mid-epoch re-size, validate at exactly the
        planned batches. Lightning validates where ``(batch_idx + 1) % val_check_batch == 0``."""
        validates = None if self.validation is None else self.validation.validates_after(batch_idx)
        if validates is not None:
            trainer.val_check_batch = batch_idx + 1 if validates else trainer.num_training_batches + 1

    def _on_real_slots(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        def on_real_slot(*args: Any, **kwargs: Any) -> Any:
            return hook(*args, **kwargs) if self._slot_is_real() else None

        return on_real_slot


def _skip(*args: Any, **kwargs: Any) -> None:
    return None
