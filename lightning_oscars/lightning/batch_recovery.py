"""Surviving a lost rank under ``balance="batch"``: the survivors save, and a restart of the same script goes on.

Batch balancing takes ddp's synchronous steps, so every survivor holds the same model, optimizer and loop position
when a peer dies: the step's gradient all-reduce (or any other collective, all of which every rank runs at the same
batch) breaks on all of them alike, before the step's optimizer update. Each survivor then writes its state to a
recovery point as it stood after the last optimizer step, its loop position rewound to that step's first batch: a
step whose all-reduce broke is trained again whole, micro-batches of an accumulation included, and no sample of a
step that was taken is trained twice. A restarted fit finds the point as under local steps (``recovery.py``'s
``find_recovery_point``) and resumes from it, in a world of any size: the epoch goes on from the samples the failed
world had trained (``share_loader.resumed_batches``). Nothing needs merging: the survivors' models are one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer

from lightning_oscars.core.recovery_points import RecoveryPoint, RecoveryStore, model_fingerprint
from lightning_oscars.dist.faults import broke_a_collective
from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.patches import Patches
from lightning_oscars.lightning.recovery import RECOVERY_GRACE_S
from lightning_oscars.lightning.signal_patch import DeferredSignals

__all__ = ["BatchRecovery"]


class BatchRecovery:
    """One batch-balanced fit's part in surviving a lost rank (see the module docstring).

    Args:
        store: where recovery points are written.
        point: the point this fit resumes from (``None``: it starts as usual).
        rank, world_size: this process's place.
    """

    def __init__(self, store: RecoveryStore, point: RecoveryPoint | None, rank: int, world_size: int) -> None:
        self.store, self.point = store, point
        self.rank, self.world_size = rank, world_size
        self._patches = Patches()
        self._failed = False

    @property
    def survivor(self) -> bool:
        """This rank resumes from its own state (not a copy given to a rank the failed world did not have)."""
        return self.point is not None and self.point.merge_weight(self.rank) > 0

    def begin(self) -> None:
        """Under Lightning's own launcher, rank 0 kills every rank within 5 s of one dying: that waits, so that the
        survivors live to save their state."""
        DeferredSignals.defer_process_watch(self._patches, RECOVERY_GRACE_S)

    def end(self) -> None:
        """The fit is over: a failed one keeps the kill deferred (it goes with the process, which is ending)."""
        self._patches.undo(keep=internals.is_child_process_watch if self._failed else lambda owner: False)

    def stepped(self) -> None:
        """An optimizer step of the restarted fit was taken on every rank: the point is this fit's past."""
        if self.point is not None:
            if self.rank == 0:
                self.store.discard(through_step=self.point.global_step)
            self.point = None

    def fit_ended(self) -> None:
        if self.rank == 0:
            self.store.discard()

    def failed(self, error: BaseException, trainer: Trainer, state: dict[str, Any], resume_batch: int) -> None:
        """The fit is ending with ``error``. Where a collective broke (a peer is gone), save this rank's state with
        Lightning's loop rewound to ``resume_batch`` of the current epoch, the first batch of the step not taken;
        ``state`` is the session's own (``"oscars_batch"``)."""
        self._failed = True
        if not broke_a_collective(error):
            return  # this rank's own error: the others' collectives break, and they save
        if self.point is not None:  # a restarted fit that failed before its first step: its point is still the newest
            self._tell(Path(self.point.directory))
            return
        try:
            checkpoint = internals.full_checkpoint(trainer)
            internals.rewind_batch_progress(checkpoint, resume_batch)
            checkpoint["oscars_batch"] = {**state, "rng": internals.rng_states()}
            saved = self.store.save(
                checkpoint,
                rank=self.rank,
                replica=self.rank,
                world_size=self.world_size,
                global_step=trainer.global_step,
                epoch=trainer.current_epoch,
                round_units=0,
                model=model_fingerprint(trainer.lightning_module),
            )
        except Exception as save_error:  # noqa: BLE001 - the failure being reported matters more than this one
            print(f"oscars: saving rank {self.rank}'s state for a restart failed too: {save_error}", file=sys.stderr)
            return
        self._tell(saved)

    def _tell(self, point: Path) -> None:
        # Lightning prints the error itself; where the state went, only this rank knows.
        print(
            f"oscars: rank {self.rank} lost a peer.\nThis rank's state is saved in {point}: a restarted fit resumes"
            " from it.",
            file=sys.stderr,
            flush=True,
        )
