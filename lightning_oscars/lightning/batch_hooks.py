"""The strategy's hooks under ``balance="batch"``: where a batch-balanced fit differs from ddp's own path.

A mixin of ``OscarsStrategy`` (``strategy.py``): the fit's :class:`~lightning_oscars.lightning.batch_balance.
BatchBalanceSession` is ``_batch`` (``None`` under local steps, where every hook here passes straight on). It scales
the loss before backward and makes the step's all-reduce after it, marks Lightning's gradient accumulation, and
keeps the shares in checkpoints under ``"oscars_batch"``: to anything else, such a checkpoint reads as ddp's.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_oscars.core.recovery_points import RecoveryPoint
from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.batch_balance import BatchBalanceSession
from lightning_oscars.lightning.batch_recovery import BatchRecovery
from lightning_oscars.lightning.recovery import recovery_store

__all__ = ["BatchBalanceHooks"]

CHECKPOINT_KEY = "oscars_batch"


class BatchBalanceHooks(DDPStrategy):
    """See the module docstring. The subclass calls :meth:`_begin_batch_fit` and :meth:`_end_batch_fit`."""

    _batch: BatchBalanceSession | None = None
    _last_batch: BatchBalanceSession | None = None
    _restored_batch: dict[str, Any] | None = None
    _restored_steps: bool = False  # the checkpoint being resumed was written under local steps

    @property
    def batch_session(self) -> BatchBalanceSession | None:
        """The current (or last) fit under ``balance="batch"`` (``None`` before one): its shares, changes, steps."""
        return self._batch or self._last_batch

    def _begin_batch_fit(self, trainer: Trainer, point: RecoveryPoint | None = None) -> None:
        """A fit under ``balance="batch"`` starts (``self`` holds the strategy's options: ``OscarsOptions``), resuming
        from the recovery ``point`` if one was found."""
        self._end_batch_fit()
        options: Any = self
        restored, self._restored_batch = self._restored_batch, None
        resumed_from_local_steps, self._restored_steps = self._restored_steps, False
        self._batch = BatchBalanceSession(
            self,
            batch_sizes=options.batch_sizes,
            warmup_steps=options.warmup_steps,
            min_gain=options.min_gain,
            smoothing=options.smoothing,
            step_times=options.pinned_step_times,
            seed=options.seed,
            restored=restored,
            resumed_from_local_steps=resumed_from_local_steps,
            monitor=options.monitor,
            recovery=self._batch_recovery(trainer, point),
        )
        self._batch.begin(trainer)

    def _batch_recovery(self, trainer: Trainer, point: RecoveryPoint | None) -> BatchRecovery | None:
        options: Any = self
        if not options.recovery:
            return None
        store = recovery_store(trainer, options.recovery_dir)
        return BatchRecovery(store, point, self.global_rank, self.world_size)

    def _end_batch_fit(self) -> None:
        session, self._batch = self._batch, None
        if session is not None:
            session.end()
            self._last_batch = session

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        session = self._batch
        if session is None or not session.fitting(internals.trainer_of(self.lightning_module)):
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # Strategy.backward's steps, with the loss scaled by this rank's share before it and the step's all-reduce
        # after it (before on_after_backward, which sees the mean gradient as under ddp).
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        loss = self.precision_plugin.pre_backward(closure_loss * session.loss_weight(), module)
        self.precision_plugin.backward(loss, module, optimizer, *args, **kwargs)
        session.after_backward()
        loss = self.precision_plugin.post_backward(loss, module)
        self.post_backward(loss)
        return loss

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator:
        session = self._batch
        if session is None:
            with super().block_backward_sync():
                yield
            return
        with session.accumulating():
            yield

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        session = self._batch
        if session is not None and session.fitting(internals.trainer_of(self.lightning_module)):
            checkpoint[CHECKPOINT_KEY] = session.state_dict()
            session.pause()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._restored_batch = checkpoint.get(CHECKPOINT_KEY)
        self._restored_steps = checkpoint.get("oscars") is not None
        return checkpoint
