"""Ordinary Lightning code (issue 29's uses): modules whose idioms once made oscars hang, lose data or let ranks
diverge. Built by ``run_case.py``; each records what a test needs to compare the ranks with what ddp would give."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric
from toy import ToyModule, blobs


class RareMetricModule(ToyModule):
    """A torchmetrics ``Metric`` updated and logged only at ``batch_idx % 4 == 2`` (a rank whose real slots never
    fall there never logs it), beside one logged at every real step: both synchronise themselves at the epoch end."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rare_loss = MeanMetric()
        self.every_loss = MeanMetric()
        self.rare_sums: list[list[float]] = []  # per epoch: [sum of the values this rank fed, their count]

    def on_train_epoch_start(self) -> None:
        self.rare_sums.append([0.0, 0.0])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.seen += len(y)
        self.steps_taken += 1
        self.every_loss(loss.detach())
        self.log("every_loss", self.every_loss, on_step=True, on_epoch=True)
        if batch_idx % 4 == 2:
            self.rare_loss(loss.detach())
            self.rare_sums[-1][0] += float(loss.detach())
            self.rare_sums[-1][1] += 1
            self.log("rare_loss", self.rare_loss, on_step=True, on_epoch=True)
        return loss


class StepMonitoredModule(ToyModule):
    """``train_loss`` logged at every step with ``sync_dist=True`` and nothing at the epoch level: checkpoint and
    early-stopping callbacks monitor that step value."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.seen += len(y)
        self.steps_taken += 1
        self.log("train_loss", loss, sync_dist=True)
        return loss


class EpochMeanModule(ToyModule):
    """The ``training_step_outputs`` idiom: every step's loss kept, their mean logged at the epoch end, once as most
    code does (each rank's mean weighs the same) and once with ``batch_size`` = the steps behind it."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.outputs: list[torch.Tensor] = []
        self.loss_sums: list[list[float]] = []  # per epoch: [sum of this rank's step losses, its steps]

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.seen += len(y)
        self.steps_taken += 1
        self.outputs.append(loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        losses = torch.stack(self.outputs)
        self.loss_sums.append([float(losses.sum()), float(len(losses))])
        self.log("mean_per_rank", losses.mean(), sync_dist=True)
        self.log("mean_per_step", losses.mean(), sync_dist=True, batch_size=len(losses))
        self.outputs.clear()


class TwoLoaderModule(ToyModule):
    """``train_dataloader`` returns a dict of loaders (Lightning combines them, ``max_size_cycle``)."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch["a"], batch_idx)

    def train_dataloader(self):
        return {
            "a": DataLoader(blobs(128), batch_size=8, shuffle=True),
            "b": DataLoader(blobs(64, seed=5), batch_size=8, shuffle=True),
        }


class MonitorState(Callback):
    """What ModelCheckpoint and EarlyStopping decided, as each rank holds it at the end of fit."""

    def __init__(self) -> None:
        self.state: dict = {}

    def on_train_end(self, trainer, pl_module) -> None:
        from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

        def number(value):
            return None if value is None else float(value)

        for i, cb in enumerate(trainer.callbacks):
            if isinstance(cb, ModelCheckpoint):
                self.state[f"checkpoint{i}"] = {
                    "best_model_path": cb.best_model_path,
                    "best_model_score": number(cb.best_model_score),
                    "best_k_models": {k: float(v) for k, v in cb.best_k_models.items()},
                    "kth_best_model_path": cb.kth_best_model_path,
                    "last_model_path": cb.last_model_path,
                    "current_score": number(cb.current_score),
                }
            elif isinstance(cb, EarlyStopping):
                self.state[f"early_stopping{i}"] = {
                    "best_score": number(cb.best_score),
                    "wait_count": cb.wait_count,
                    "stopped_epoch": cb.stopped_epoch,
                }
