"""A Lightning script written for ``strategy="ddp"``, run unchanged under ``strategy="oscars"``.

    python examples/drop_in.py --strategy ddp     --out lightning_logs/drop_in_ddp
    python examples/drop_in.py --strategy oscars  --out lightning_logs/drop_in_oscars

The module below is an ordinary DDP-style LightningModule (``self.log(..., sync_dist=True)``, validation, a
per-step OneCycle LR schedule sized from ``trainer.estimated_stepping_batches``, ``ModelCheckpoint`` on
``val_acc``, a CSV logger with ``LearningRateMonitor``); the only difference between the two runs is the
strategy string. Rank 1 is emulated ``--slowdown`` times slower (:class:`~lightning_oscars.HeterogeneityEmulator`,
identical under both strategies). Rank 0 writes ``OUT/result.json``: validation accuracy after ``fit``, global
step, the OneCycle length and the final LR, wall time.

What behaves differently under ``oscars``, and why (ranks train locally and average every round, the fast ones
taking more local steps):

* **Gradients are not all-reduced per step.** The model is not wrapped in ``DistributedDataParallel``; every
  ``tau_i`` local steps (one round) parameters and buffers are averaged with one all-reduce. DDP options
  (``find_unused_parameters``, ``static_graph``, ``ddp_comm_hook``, ...) have no effect or are rejected. Each
  local step sees only its rank's batch, so there are more, noisier steps than under DDP's global batch: a
  learning rate tuned for ddp usually works but is worth re-checking.
* **global_step counts slots, not every rank's real steps.** It advances with the busiest rank; a slower rank
  spends the remaining slots of a round as no-ops (no data, no forward/backward) while its counters, hooks and
  step-interval LR schedulers advance like everyone else's. So ``max_steps``, ``val_check_interval``,
  ``every_n_train_steps`` and the LR are the same on all ranks at the same batch.
* **Epoch length and estimated_stepping_batches.** The training data are split in proportion to speed (rank
  ``i`` gets ``tau_i`` batches per round) instead of by ``DistributedSampler``, and the epoch has as many
  slots as the busiest rank needs. ``estimated_stepping_batches`` is computed before the speeds are known, from
  an upper bound on that (no schedule needs more), so a OneCycle / cosine schedule sized from it never
  overruns, but under oscars it ends before reaching its final LR (here: 182 of 242 steps). Pinned
  ``step_times`` make it exact; ``interval="epoch"`` schedules are unaffected.
* **self.log inside training_step.** ``on_step=True, sync_dist=True`` logs the rank-local value (the ranks run
  different numbers of steps, so a per-step reduction could never be matched); ``on_epoch=True`` values and
  everything logged in validation/test are reduced as under ddp.
* **Collectives inside training_step** cannot be matched either: a raw ``torch.distributed.all_reduce`` acts
  as if every rank held this rank's values (a self-supervised loss's per-step center works), and every other
  collective (``self.all_gather``, ``trainer.strategy.barrier`` / ``broadcast``, raw gathers, torchmetrics with
  ``dist_sync_on_step=True``) raises a clear error naming the call. Torchmetrics objects that sync at
  ``compute()`` (the default, as in ``examples/synthetic.py``) work.
* **Validation, checkpoints, end of fit** see the averaged model: the strategy averages right before them, so
  ``ModelCheckpoint``, ``EarlyStopping`` on validation metrics and ``trainer.validate``/``test`` after ``fit``
  behave as under ddp, and every rank ends ``fit`` with identical weights. Checkpoints also store the schedule
  under the key ``"oscars"``. A stop decided mid-epoch (``EarlyStopping`` with ``val_check_interval``)
  takes effect at the next round boundary.
* **Optimizer state** (momentum, Adam moments) stays local unless ``average_optimizer_state=True``;
  **BatchNorm** running statistics are averaged every round (``sync_batchnorm=True`` is rejected).
* **Stopping.** ``trainer.should_stop`` set during a batch, ``max_time`` and SIGTERM take effect at the next
  round boundary, on all ranks together.
* **Not supported** (clear error at setup): iterable datasets, a custom ``batch_sampler``, a time-based
  ``val_check_interval``, ``overfit_batches``, ``training_step(dataloader_iter)``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic import gaussian_mixture  # noqa: E402

import lightning_oscars  # noqa: E402,F401  (registers strategy="oscars"; harmless under ddp)
from lightning_oscars import HeterogeneityEmulator  # noqa: E402


class Classifier(L.LightningModule):
    """A typical DDP-era module: nothing in it knows about oscars."""

    def __init__(self, lr: float = 0.1, batch_size: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.batch_size = lr, batch_size
        self.total_steps = 0  # the OneCycle length, set in configure_optimizers
        self.net = nn.Sequential(
            nn.Linear(32, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("train_acc", (logits.argmax(-1) == y).float().mean(), on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, nesterov=True)
        self.total_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(gaussian_mixture(8192, sample_seed=0), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(gaussian_mixture(2048, sample_seed=1), batch_size=256)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="ddp", help="ddp | oscars | any Lightning strategy name")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--slowdown", type=float, default=3.0, help="rank 1 runs this many times slower (1: off)")
    parser.add_argument("--out", type=Path, default=Path("lightning_logs/drop_in"))
    args = parser.parse_args(argv)

    L.seed_everything(0)
    model = Classifier()
    checkpoint = ModelCheckpoint(dirpath=args.out / "checkpoints", monitor="val_acc", mode="max", save_last=True)
    trainer = L.Trainer(
        strategy=args.strategy,  # <- the only line that changes between ddp and oscars
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.max_epochs,
        logger=CSVLogger(args.out, name="logs"),
        callbacks=[checkpoint, LearningRateMonitor("step"), HeterogeneityEmulator({1: args.slowdown})],
        log_every_n_steps=10,
        enable_progress_bar=False,
    )
    started = time.perf_counter()
    trainer.fit(model)
    fit_seconds = time.perf_counter() - started
    metrics = trainer.validate(model, verbose=False)[0]
    result = {
        "strategy": args.strategy,
        "world_size": trainer.world_size,
        "fit_seconds": fit_seconds,
        "val_acc": metrics["val_acc"],
        "val_loss": metrics["val_loss"],
        "best_val_acc": float(checkpoint.best_model_score) if checkpoint.best_model_score is not None else None,
        "best_model_path": checkpoint.best_model_path,
        "global_step": trainer.global_step,
        "scheduled_steps": model.total_steps,  # the OneCycle length: estimated_stepping_batches at setup
        "final_lr": trainer.optimizers[0].param_groups[0]["lr"],
    }
    if trainer.is_global_zero:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
