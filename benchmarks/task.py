"""The benchmark's learnable task: a 10-class problem with nonlinear class structure, made by the project
(no downloads), and an MLP sized so a step costs a few milliseconds on one CPU core."""

from __future__ import annotations

import time

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_dataset(n: int, seed: int, dim: int = 32, classes: int = 10) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)  # the task itself is fixed; `seed` draws the samples
    centers = torch.randn(classes, 4, dim, generator=g) * 1.5  # 4 modes per class: not linearly separable
    s = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=s)
    mode = torch.randint(0, 4, (n,), generator=s)
    x = centers[y, mode] + torch.randn(n, dim, generator=s) * 1.0
    return TensorDataset(x, y)


class BenchModule(LightningModule):
    def __init__(self, lr: float = 0.05, batch_size: int = 64, n_train: int = 16384, hidden: int = 512) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(32, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )
        self.val_curve: list[tuple[float, float, float]] = []  # (seconds since fit start, val loss, val acc)
        self._t0 = 0.0

    def on_train_start(self) -> None:
        self._t0 = time.perf_counter()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        m = self.trainer.callback_metrics
        self.val_curve.append((time.perf_counter() - self._t0, float(m["val_loss"]), float(m["val_acc"])))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(make_dataset(self.hparams.n_train, seed=0), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(make_dataset(4096, seed=1), batch_size=512)
