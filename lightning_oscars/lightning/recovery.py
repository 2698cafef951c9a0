"""One fit's part in surviving a lost rank: the Lightning side of ``recovery_points.py`` and ``continuation.py``.

* :func:`find_recovery_point` (the strategy's ``setup_distributed``, every rank): rank 0 reads the newest complete
  recovery point and every rank learns it in one broadcast; the fit's restore is pointed at this rank's state.
* :meth:`FitRecovery.save` (a failed averaging, on every survivor; a coordinated stop such as SIGTERM, on every rank):
  the rank's whole state, as Lightning would checkpoint it, plus the round state and the epoch's order of samples.
  A stop's point is used only by a fit given no checkpoint (torch's elastic agent stops every rank when a node
  joins, and restarts them in the larger world).
* :meth:`FitRecovery.resume` and :meth:`FitRecovery.merge` (training start of the restarted fit): the epoch's plan
  continues where the failed round left it, and the survivors' models are merged in one weighted all-reduce.

What it covers: every registered strategy, plain or deadline rounds, with or without replica groups (a replica that
lost a rank mid-round is lost: its other ranks fail inside a step, at another slot than the rest, and save nothing).
The paradigms exchange after every step, so their survivors learn of the loss at different slots: each then trains
no further in the round and saves at the round's end (or the averaging before a validation or a checkpoint, if one
comes first), where every survivor stands at one slot (``fit_failures.py``). A parameter server's
shards die with their ranks; the survivors' worker models, each the server's state at its last pull plus its own
steps since, are what is merged, and the restarted fit starts a fresh server from the merge.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_oscars.core.continuation import continue_epoch
from lightning_oscars.core.loader import LoadBalancedLoader
from lightning_oscars.core.partition import EpochPlan
from lightning_oscars.core.recovery_points import RecoveryPoint, RecoveryStore, default_recovery_dir, model_fingerprint
from lightning_oscars.core.rounds import RoundController
from lightning_oscars.dist.local_state import average_tensors
from lightning_oscars.dist.schemes import SyncScheme
from lightning_oscars.lightning import _internals as internals

__all__ = ["RECOVERY_GRACE_S", "FitRecovery", "find_recovery_point", "recovery_store"]

# How long Lightning's launcher lets the survivors of a dead rank live (it kills them all within 5 s otherwise): they
# reach the failing averaging within a round, save, and exit on their own before.
RECOVERY_GRACE_S = 120.0


def recovery_store(trainer: Trainer, recovery_dir: str | os.PathLike[str] | None) -> RecoveryStore:
    return RecoveryStore(recovery_dir if recovery_dir is not None else default_recovery_dir(trainer.default_root_dir))


def find_recovery_point(strategy: Any, trainer: Trainer | None) -> RecoveryPoint | None:
    """When ``strategy`` (an ``OscarsStrategy`` with ``recovery``) starts fitting: the newest complete recovery point
    (rank 0 reads it, every rank gets it: one collective, on every rank), with this fit's restore pointed at this
    rank's state in it, unless the fit was given a checkpoint written after it. ``None`` in any other case."""
    if not strategy.recovery or trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return None
    store, rank = recovery_store(trainer, strategy.recovery_dir), strategy.global_rank
    module = strategy.lightning_module
    found: list[Any] = [None]
    if rank == 0:
        try:
            point = store.latest(model_fingerprint(module))
            for ignored in store.incomplete(point):
                rank_zero_warn(
                    f"oscars: ignoring the recovery point {ignored}: no rank's state in it is complete (its ranks"
                    " failed while saving, or before)."
                    + (" Starting from the next older point." if point is not None else " There is no older point.")
                )
        except OSError as error:  # an unreadable directory must not leave the other ranks waiting in the broadcast
            rank_zero_warn(f"oscars: the recovery directory {store.root} could not be read ({error}); starting afresh")
            point = None
        found[0] = None if point is None else point.to_json()
    torch.distributed.broadcast_object_list(found, src=0)
    if found[0] is None:
        return None
    point = RecoveryPoint.from_json(found[0])
    # A checkpoint the fit was given wins if written after a failure's point (the same answer on every rank: one
    # time), and always over a coordinated stop's (the user's own checkpoint of that stop is as good).
    written = float("-inf") if point.stopped else min(os.path.getmtime(s.checkpoint) for s in point.saved)
    mine = point.assigned(rank, strategy.layout.replica_size).checkpoint
    internals.resume_from_unless_given(trainer, mine, given_before=written)
    rank_zero_warn(
        f"oscars: resuming from the recovery point the survivors of a failed round saved at global step"
        f" {point.global_step} (epoch {point.epoch}; {len(point.saved)} of {point.world_size} ranks' states) in"
        f" {point.directory}. Delete it, or pass recovery=False, to start afresh."
    )
    return point


class FitRecovery:
    """What one fit saves when a round fails, and how it resumes from a recovery point (see the module docstring).

    Args:
        store: where recovery points are written.
        point: the point this fit resumes from (``None``: it starts as usual).
        rank: this rank's global rank.
        replica_size: the ranks of a replica (one state per replica).
    """

    def __init__(self, store: RecoveryStore, point: RecoveryPoint | None, rank: int, replica_size: int = 1) -> None:
        self.store = store
        self.point = point
        self.rank = rank
        self.replica_size = replica_size
        self.merged = False  # the survivors' models were merged (the point is this fit's past from then on)
        self._order: tuple[int, list[int]] | None = None  # the resumed epoch's order of samples

    def save(
        self,
        rounds: RoundController,
        scheme: SyncScheme,
        loader: LoadBalancedLoader | None,
        trainer: Trainer,
        stopped: bool = False,
        averaged: bool = False,
    ) -> Path | None:
        """A round failed: save this survivor's state; the point's directory, or ``None`` if nothing was saved
        (nothing planned yet, or a restarted fit that failed before its merge, whose point
        is still the newest state). ``averaged``: it failed after an averaging, before anything trained (inside a
        validation or a checkpoint write); ``stopped``: a coordinated stop at a round boundary."""
        if rounds.plan is None or loader is None:
            return None
        if self.point is not None and not self.merged:
            return Path(self.point.directory)
        if stopped and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) < 1:
            return None  # a stop's point only where an agent restarts the ranks (torchrun --max-restarts=K)
        epoch = trainer.current_epoch
        # Every survivor writes its replica's whole state (sharded replicas: gathered on each of its ranks).
        with getattr(trainer.strategy, "full_state_on_every_rank", nullcontext)():
            checkpoint = internals.full_checkpoint(trainer)
        rounds_state = rounds.state_dict()
        checkpoint["oscars"] = {
            **rounds_state,
            "scheme": scheme.state_dict(),
            "recovery": {"order": loader.epoch_order(epoch), "rng": internals.rng_states()},
        }
        return self.store.save(
            checkpoint,
            rank=self.rank,
            replica=rounds.rank,
            world_size=rounds.world_size,
            global_step=trainer.global_step,
            epoch=epoch,
            round_units=int(rounds_state["round_units"]),
            stopped=stopped,
            averaged=averaged,
            model=model_fingerprint(trainer.lightning_module),
        )

    def resume(
        self,
        rounds: RoundController,
        loader: LoadBalancedLoader | None,
        restored: dict[str, Any],
        epoch: int,
        position: int | None,
        units: int | None,
    ) -> None:
        """Continue the point's epoch of ``units`` units from where the failed round left it (if Lightning resumes
        inside it; after a failure at the epoch's end, the next epoch starts whole)."""
        point = self.point
        assert point is not None
        if point.merge_weight(self.rank, self.replica_size) > 0 and "rng" in restored["recovery"]:  # not a copy
            internals.restore_rng_states(restored["recovery"]["rng"])
        plan_state = restored.get("plan")
        if loader is None or position is None or epoch != point.epoch or plan_state is None:
            return
        if restored.get("plan_epoch") != epoch or plan_state["total_units"] != units:
            return
        old = EpochPlan.from_state_dict(point.world_size, plan_state)
        slots = position // loader.batches_per_slot
        survivors = point.survivors(rounds.world_size)
        rounds.continuation = continue_epoch(old, epoch, slots, survivors, averaged=point.averaged)
        self._order = (epoch, list(restored["recovery"]["order"]))

    def order_for(self, epoch: int) -> list[int] | None:
        """The resumed epoch's order of samples (the failed world's: its units must mean the same samples)."""
        return self._order[1] if self._order is not None and self._order[0] == epoch else None

    def merge(self, tensors: list[torch.Tensor], device: torch.device, shard_group: Any = None) -> None:
        """The restarted fit's first collective: the survivors' models merged (every rank, one all-reduce; sharded
        replicas: each shard over its ``shard_group``, every rank of a surviving replica weighing 1, then the rest)."""
        assert self.point is not None
        if shard_group is None:
            weight = self.point.merge_weight(self.rank, self.replica_size)
        else:  # a replica's ranks hold different shards: each carries its replica's weight
            weight = self.point.merge_weight(self.rank - self.rank % self.replica_size, self.replica_size)
        average_tensors(tensors, weight, device, shard_group=shard_group)
        self.merged = True

    def averaged(self) -> None:
        """A round after the merge was averaged: the point it resumed from is this fit's past (rank 0 removes it)."""
        if self.point is not None and self.merged and self.rank == 0:
            self.store.discard(through_step=self.point.global_step)
            self.point = None

    def fit_ended(self) -> None:
        """The fit ended well: no recovery point is left to resume from."""
        if self.rank == 0:
            self.store.discard()
