"""The learning-rate finder inside a fit under oscars.

Its callback broadcasts its stop decision after every real step and returns before the broadcast when the step
produced no loss. On a no-op slot (no loss: not the repeated outputs other callbacks see, which would record a step
twice) the broadcast is made here, so every rank meets it at every optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer

from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.patches import Patches

__all__ = ["LRFinderSlots"]


class LRFinderSlots:
    """The learning-rate finder's per-step hook, for one fit. ``slot_is_real``: whether the batch is a real step."""

    def __init__(self, slot_is_real: Callable[[], bool]) -> None:
        self._slot_is_real = slot_is_real

    def install(self, trainer: Trainer, patches: Patches) -> None:
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if internals.is_lr_finder_callback(callback):
                patches.replace(
                    callback, "on_train_batch_end", self.broadcast_on_noop_slots(callback.on_train_batch_end)
                )

    def broadcast_on_noop_slots(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        def on_train_batch_end(trainer: Trainer, *args: Any, **kwargs: Any) -> Any:
            real = self._slot_is_real()
            if not real:  # no loss on a no-op slot: it records a NaN
                if "outputs" in kwargs:
                    kwargs["outputs"] = {}
                elif len(args) >= 2:  # (pl_module, outputs, batch, batch_idx)
                    args = (args[0], {}, *args[2:])
            result = hook(trainer, *args, **kwargs)
            stepped = (trainer.fit_loop.batch_idx + 1) % trainer.accumulate_grad_batches == 0
            if not real and stepped:
                trainer.should_stop = trainer.strategy.broadcast(trainer.should_stop)
            return result

        return on_train_batch_end
