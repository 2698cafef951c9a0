"""A small learnable task shared by the multi-process tests: Gaussian blobs classified by an MLP with BatchNorm."""

from __future__ import annotations

import time

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def blobs(n: int = 512, dim: int = 16, classes: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g) * 2.0
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, dim, generator=g)
    return TensorDataset(x, y)


class ToyModule(LightningModule):
    def __init__(self, lr: float = 0.05, step_cost: float = 0.0, n: int = 512, batch_size: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
        self.lr = lr
        self.step_cost = step_cost  # seconds of emulated compute per step
        self.n = n
        self.batch_size = batch_size
        self.seen = 0  # samples this rank trained on
        self.steps_taken = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.step_cost:
            time.sleep(self.step_cost)
        loss = nn.functional.cross_entropy(self(x), y)
        self.seen += len(y)
        self.steps_taken += 1
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(blobs(self.n), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(blobs(128, seed=1), batch_size=32)

    def test_dataloader(self):
        return DataLoader(blobs(128, seed=2), batch_size=32)

    def predict_dataloader(self):
        return DataLoader(blobs(64, seed=3), batch_size=32)
