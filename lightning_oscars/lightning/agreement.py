"""One figure per metric on every rank where Lightning's callbacks decide, though the ranks took different steps.

Under oscars a step value logged in ``training_step`` is each rank's own, and an epoch-end ``sync_dist`` reduction
may cover keys some rank never logged. :class:`MetricAgreement` makes them agree where every rank is anyway: at a
training epoch's end (``epoch_metrics.align_epoch_metrics``, then the step values) and before a validation or a
checkpoint decides on a step value. Each is one small collective, on every rank, or none once a collective failed.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy

from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.epoch_metrics import StepValueAgreement, align_epoch_metrics, module_metric

__all__ = ["MetricAgreement"]


class MetricAgreement:
    """The agreements of one fit under ``strategy`` (see the module docstring)."""

    def __init__(self, strategy: ParallelStrategy) -> None:
        self.strategy = strategy
        self.step_values = StepValueAgreement()

    def align_epoch_metrics(self, trainer: Trainer, failed: bool = False) -> None:
        """Match the epoch-end ``sync_dist`` reductions and self-synchronising metrics across ranks (see
        ``epoch_metrics.py``) and agree on the step values callbacks read at the epoch end: one small collective at
        every training epoch end, on every rank (none when ``failed``)."""
        s = self.strategy
        results = internals.epoch_results(trainer)
        if failed or results is None:
            return
        steps: list[dict[str, tuple[str, float]]] = []

        def gather(keys: dict[str, dict[str, Any]]) -> list[dict[str, dict[str, Any]]]:
            everyone = self._gather_objects((keys, self.step_values.step_values(results)))
            steps.extend(step for _, step in everyone)
            return [keys for keys, _ in everyone]

        module = s.lightning_module
        assert module is not None
        align_epoch_metrics(results, gather, s.reduce, s.root_device, partial(module_metric, module))
        self.step_values.agree(results, steps, internals.callback_metric_store(trainer))

    def agree_step_values(self, trainer: Trainer, failed: bool = False) -> None:
        """Give callbacks about to decide on step values (a validation's, a checkpoint's) one figure on every rank.
        Collective: call it where every rank is (a validation's start, a batch where a checkpoint is due)."""
        if failed:
            return
        results = internals.training_results(trainer)
        if results is None:
            return
        everyone = self._gather_objects(self.step_values.step_values(results))
        self.step_values.agree(results, everyone, internals.callback_metric_store(trainer))

    def _gather_objects(self, mine: Any) -> list[Any]:
        everyone: list[Any] = [None] * self.strategy.world_size
        torch.distributed.all_gather_object(everyone, mine)
        return everyone
