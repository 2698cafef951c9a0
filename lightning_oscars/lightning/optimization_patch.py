"""The optimization loops on a no-op slot: the step is skipped, its counters advance.

On a no-op slot (this rank has finished its local steps of the round; Lightning still fetches a batch for it) the
automatic loop skips the forward, backward and optimizer step but counts the step, so ``global_step`` is the same on
every rank; it also closes a partial accumulation unit (the epoch's last batches), as ddp applies it at the epoch's
last batch. The manual loop counts as many optimizer steps as the rank's last real batch took. Callbacks see the last
real step's outputs again (``SpikeDetection`` reads its ``"loss"``), and the logger connector does not log the last
real step's values a second time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Trainer

from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.patches import Patches

__all__ = ["NoopSlots"]


class NoopSlots:
    """The optimization loops' run and the step logging, for one fit. ``slot_is_real`` says whether the batch in
    progress is a real local step of this rank; ``device`` is where a partial unit's zero loss lives."""

    def __init__(self, slot_is_real: Callable[[], bool], device: torch.device) -> None:
        self._slot_is_real = slot_is_real
        self._device = device
        self.last_outputs: Any = {}  # the last real step's outputs: what callbacks see on a no-op slot
        self._pending_accumulation = False  # a partial unit's gradients wait for the epoch's next no-op slot
        self._manual_steps_per_batch = 0

    def install(self, trainer: Trainer, patches: Patches) -> None:
        loop = trainer.fit_loop.epoch_loop
        patches.replace(loop.automatic_optimization, "run", self._automatic_run(loop))
        patches.replace(loop.manual_optimization, "run", self._manual_run(loop.manual_optimization))
        connector = internals.logger_connector(trainer)
        log_step = connector.update_train_step_metrics

        def update_train_step_metrics() -> None:
            if self._slot_is_real():  # a no-op slot logged nothing new: do not re-log the last real step's values
                log_step()

        patches.replace(connector, "update_train_step_metrics", update_train_step_metrics)

    def start_epoch(self) -> None:
        self._pending_accumulation = False

    def forget(self) -> None:
        self.last_outputs = {}

    def _automatic_run(self, loop: Any) -> Callable[..., Any]:
        automatic = loop.automatic_optimization
        run = automatic.run

        def automatic_run(optimizer: Any, batch_idx: int, kwargs: Any) -> Any:
            stepping = not internals.should_accumulate(loop)
            if self._slot_is_real():
                self._pending_accumulation = not stepping
                self.last_outputs = run(optimizer, batch_idx, kwargs)
                return self.last_outputs
            if stepping and self._pending_accumulation:
                # The slot's unit was partial (the epoch's last batches): its real batches ran first and their
                # gradients wait for this step, as ddp applies a partial unit at the epoch's last batch.
                self._pending_accumulation = False
                internals.optimizer_step(automatic, batch_idx, lambda: torch.zeros((), device=self._device))
            elif stepping:
                automatic.optim_progress.optimizer.step.increment_ready()
                automatic.optim_progress.optimizer.step.increment_completed()
            # A no-op slot shows the rank's last real step's outputs, as if that step were repeated, rather than a
            # dict without the keys every real step has.
            return self.last_outputs

        return automatic_run

    def _manual_run(self, manual: Any) -> Callable[..., Any]:
        run = manual.run

        def manual_run(kwargs: Any) -> Any:
            progress = manual.optim_step_progress
            if self._slot_is_real():
                before = progress.total.completed
                self.last_outputs = run(kwargs)
                self._manual_steps_per_batch = progress.total.completed - before
                return self.last_outputs
            for _ in range(self._manual_steps_per_batch):  # keep global_step equal on every rank
                progress.increment_ready()
                progress.increment_completed()
            return self.last_outputs

        return manual_run
