"""What one fit under oscars changes in Lightning, installed together and removed together.

Ranks under oscars run the same batches but take different numbers of real steps, and must not meet per batch.
Lightning 2.6 has no public hook for that, so a fit changes, for its duration (:meth:`LightningAdapter.install` /
:meth:`LightningAdapter.remove`; the strategy's ``teardown`` removes them), by what each piece patches:

* the optimization loops (``optimization_patch``): a no-op slot's step is skipped, its counters advance;
* the epoch loop (``epoch_patch``): its length and validation points are the plan's; its per-batch collectives
  (SIGTERM broadcast, step ``Timer``) become no-ops, ``ThroughputMonitor`` counts real slots;
* the signals (``signal_patch``): SIGTERM and requeue act at the round boundary; the process watch waits;
* the tuner (``tuner_patch``): the learning-rate finder's per-step broadcast is met on no-op slots.

Every private attribute these touch is named in ``_internals``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Trainer

from lightning_oscars.core.epoch_shape import EpochShape
from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.epoch_patch import EpochLength
from lightning_oscars.lightning.optimization_patch import NoopSlots
from lightning_oscars.lightning.patches import MethodPatch, Patches
from lightning_oscars.lightning.signal_patch import DeferredSignals
from lightning_oscars.lightning.tuner_patch import LRFinderSlots

__all__ = ["LightningAdapter"]


class LightningAdapter:
    """The patches of one fit. ``slot_is_real`` says whether the batch in progress is a real local step of this rank;
    ``device`` is where a partial accumulation unit's zero loss lives."""

    def __init__(self, slot_is_real: Callable[[], bool], device: torch.device) -> None:
        self._patches = Patches()
        self.optimization = NoopSlots(slot_is_real, device)
        self.epoch = EpochLength(slot_is_real)
        self.signals = DeferredSignals()
        self.tuner = LRFinderSlots(slot_is_real)

    @property
    def installed(self) -> bool:
        return bool(self._patches)

    def install(self, trainer: Trainer, on_sigterm: Callable[[], None], on_requeue: Callable[[], None]) -> None:
        self.remove()
        self.epoch.install(trainer, self._patches)
        self.tuner.install(trainer, self._patches)
        self.optimization.install(trainer, self._patches)
        if threading.current_thread() is threading.main_thread():  # handlers can be set on the main thread only
            self.signals.install(trainer, self._patches, on_sigterm, on_requeue)

    def defer_zombie_guard(self, grace_s: float) -> None:
        """Under Lightning's own launcher, rank 0 SIGKILLs every rank within 5 s of one dying: the kill waits
        ``grace_s``, so that the survivors can save their state for a restart. Undone by :meth:`remove`."""
        self.signals.defer_process_watch(self._patches, grace_s)

    def patch(self, owner: object, name: str, replacement: Any) -> None:
        """Replace the method ``owner.name`` with ``replacement`` until :meth:`remove` (the session's patches of user
        objects; a copy or pickle of ``owner`` gets its own method back, see ``MethodPatch``)."""
        self._patches.replace(owner, name, MethodPatch(replacement, owner, name))

    def remove(self, keep_zombie_guard: bool = False) -> None:
        """Put back everything :meth:`install` and :meth:`defer_zombie_guard` changed (a handler someone replaced since
        stays theirs). ``keep_zombie_guard``: a fit that failed leaves the kill deferred, so that the process lives to
        print its error and the other survivors to save (it goes with the process, which is ending)."""
        self._patches.undo(keep=internals.is_child_process_watch if keep_zombie_guard else lambda owner: False)
        self.optimization.forget()
        self.epoch.forget()
        self.signals.forget()

    # ------------------------------------------------------------------ what the session asks

    def read_epoch(self, trainer: Trainer) -> EpochShape:
        """Lightning's counters for the epoch about to be planned, read once."""
        return self.epoch.read_shape(trainer)

    def size_epoch(self, trainer: Trainer, batches: int, mid_epoch: bool = False) -> None:
        self.epoch.size(trainer, batches, mid_epoch)

    def pace_validation(self, trainer: Trainer, batch_idx: int) -> None:
        self.epoch.pace_validation(trainer, batch_idx)

    def start_epoch(self) -> None:
        self.optimization.start_epoch()

    def timer_expired(self) -> bool:
        return self.epoch.timer_expired()

    def run_requeue_handler(self) -> None:
        self.signals.run_requeue_handler()
