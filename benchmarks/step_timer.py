"""A callback that times a fit's training steps from inside it: used by ``benchmarks.gpu_check`` through
LightningCLI (``--trainer.callbacks+={"class_path": "benchmarks.step_timer.StepTimer", ...}``)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


class StepTimer(Callback):
    """A Lightning callback (loaded by class path) that times each training step and the wait for its batch.

    A step is timed from ``on_train_batch_start`` to ``on_train_batch_end`` with the device synchronised at both,
    so it is the device's work; the wait is the host time between one step's end and the next one's start (the
    data loader). The first ``skip`` steps (kernel selection, the loader's start) are left out.
    """

    def __init__(self, out: str, skip: int = 20) -> None:
        self.out, self.skip = out, skip
        self.steps: list[float] = []
        self.waits: list[float] = []
        self._start = self._end = 0.0
        self.batch_size = 0

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._sync()
        self._start = time.perf_counter()
        if self._end:
            self.waits.append(self._start - self._end)
        self.batch_size = len(batch[0])

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sync()
        self._end = time.perf_counter()
        self.steps.append(self._end - self._start)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        steps, waits = self.steps[self.skip :], self.waits[self.skip :]
        if not steps:
            raise RuntimeError(f"only {len(self.steps)} steps: fewer than the {self.skip} skipped")
        step, wait = statistics.median(steps), statistics.median(waits)
        Path(self.out).write_text(
            json.dumps({"steps": len(steps), "batch": self.batch_size, "step_ms": 1e3 * step, "wait_ms": 1e3 * wait})
        )
