"""Lightning's own collectives and checkpoints on a strategy whose ranks take different numbers of steps.

Inside a local step a collective could never be matched (the other ranks run a different number of steps): a
``reduce`` (``self.log(..., sync_dist=True)``) stays rank-local there, and ``all_gather``, ``barrier`` and
``broadcast`` are refused with an error that says where to move them. After a failed collective the peers are gone
or will not come, so none is attempted. A checkpoint holds the averaged model and the fit's round state (under
``"oscars"``); the write, and the barrier Lightning holds after it, are left out of the training time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.apply_func import convert_to_tensors
from lightning.pytorch.strategies import DDPStrategy
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from typing_extensions import override

from lightning_oscars.dist.local_collectives import gather_ragged
from lightning_oscars.lightning import _internals as internals

if TYPE_CHECKING:
    from lightning_oscars.lightning.session import FitSession

__all__ = ["CHECKPOINT_BARRIER", "LocalStepCollectives"]

# The barrier Lightning's Trainer.save_checkpoint holds after every write: the other ranks wait there for the writer.
CHECKPOINT_BARRIER = "Trainer.save_checkpoint"


class LocalStepCollectives(DDPStrategy):
    """``DDPStrategy``'s collectives and checkpoints, made safe for local steps (see the module docstring). The
    subclass keeps ``_in_local_step`` (set around ``training_step``), ``_session`` (the fit in progress),
    ``_checkpoint_written`` (a checkpoint write's barrier is next) and ``_restored`` (a loaded checkpoint's round
    state, for the next fit)."""

    _session: FitSession | None
    _in_local_step: bool
    _checkpoint_written: bool
    _restored: dict[str, Any] | None

    def state_dict(self) -> dict[str, Any]:
        """Schedule, timing estimates, the epoch's plan and the scheme's state, as stored in checkpoints under
        ``"oscars"`` (``{}`` outside a fit)."""
        session = self._session
        if session is None:
            return {}
        return {**session.rounds.state_dict(), "scheme": session.scheme.state_dict()}

    def average_if_pending(self) -> None:
        """Average now if any rank trained since the last averaging or its result is still to be applied (the same
        answer on every rank); nothing outside a fit."""
        if self._session is not None:
            self._session.average_if_pending()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Called by trainer.save_checkpoint on every rank: checkpoints hold the averaged model.
        self.average_if_pending()
        return super().lightning_module_state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        session = self._session
        fitting = session is not None and session.fitting(internals.trainer_of(self.lightning_module))
        if fitting:
            checkpoint["oscars"] = self.state_dict()
        started = time.perf_counter()
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if fitting:
            # Neither the write (rank 0) nor the barrier after it (the others wait for the writer) is a step or a
            # round's fixed cost: both are left out like validation, or a slow file system would read as a costly
            # all-reduce and lengthen every round.
            self._exclude_time(time.perf_counter() - started)
            self._checkpoint_written = True

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._restored = checkpoint.get("oscars")
        return checkpoint

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if self._in_local_step or self._failed:
            # self.log(..., sync_dist=True) inside a local step: ranks run different numbers of steps, so the
            # value stays rank-local here; epoch-level aggregates are reduced at the epoch end as usual.
            return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        self._forbid_collective("all_gather")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def barrier(self, name: str | None = None) -> None:
        self._forbid_collective("barrier")
        started = time.perf_counter()
        if not self._failed:  # when failed, the peers are gone or will not come: it would wait for the timeout
            super().barrier(name)
        if self._checkpoint_written and name == CHECKPOINT_BARRIER:
            self._checkpoint_written = False  # the wait for the writer is no more training than the write
            self._exclude_time(time.perf_counter() - started)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._forbid_collective("broadcast")
        return obj if self._failed else super().broadcast(obj, src)

    def module_all_gather(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """A fit's ``LightningModule.all_gather``: ranks that trained different numbers of batches gather lists of
        different lengths (each rank's trained sample ids, gathered at the end of training). The shapes are compared
        first (one small gather); equal ones go through Lightning's own ``all_gather``, a list of tensors of different
        lengths is gathered by :func:`~lightning_oscars.dist.local_collectives.gather_ragged`, anything else raises on
        every rank alike."""
        strategy, name = self, getattr(self, "strategy_name", "oscars")

        def all_gather(data: Any, group: Any = None, sync_grads: bool = False) -> Any:
            if strategy._in_local_step or strategy._failed:
                return original(data, group=group, sync_grads=sync_grads)  # refused there, with the reason
            module = strategy.lightning_module
            tensors = convert_to_tensors(data, device=module.device if module is not None else strategy.root_device)
            shapes = apply_to_collection(tensors, Tensor, lambda t: tuple(t.shape))
            everyone: list[Any] = [None] * torch.distributed.get_world_size(group)
            torch.distributed.all_gather_object(everyone, shapes, group=group)
            if all(other == shapes for other in everyone):
                return original(data, group=group, sync_grads=sync_grads)
            if isinstance(tensors, (list, tuple)) and all(isinstance(t, Tensor) for t in tensors) and not sync_grads:
                lists = [other for other in everyone if isinstance(other, (list, tuple))]
                if len(lists) == len(everyone) and all(
                    a == b
                    for other in lists
                    for a, b in zip(other, shapes)  # equal shapes where both lists have one
                ):
                    return gather_ragged(list(tensors), group=group)
            raise RuntimeError(
                f"all_gather got data of different shapes on the ranks ({everyone}): under strategy={name!r} ranks"
                " train different numbers of batches, so what each rank collected differs in length. A list of"
                " tensors (one per batch) is gathered with ragged lengths; for one tensor, pad it to a length every"
                " rank knows, or gather a list."
            )

        return all_gather

    @property
    def _failed(self) -> bool:
        """A collective of this fit failed: the peers are gone or will not come."""
        return self._session is not None and self._session.rounds.failed

    def _exclude_time(self, seconds: float) -> None:
        if self._session is not None:
            self._session.rounds.exclude_time(seconds)

    def _exclude_checkpoint_time(self, seconds: float) -> None:
        """A checkpoint's write during a fit is left out of the training time (see :meth:`save_checkpoint`)."""
        session = self._session
        if session is not None and session.fitting(internals.trainer_of(self.lightning_module)):
            self._exclude_time(seconds)

    def _forbid_collective(self, name: str) -> None:
        if self._in_local_step:
            raise RuntimeError(
                f"{name} was called inside training_step, which under strategy='oscars' runs a different number"
                " of times on every rank, so the collective could never be matched. Move it to an epoch or"
                " validation hook, or use strategy='ddp'."
            )
