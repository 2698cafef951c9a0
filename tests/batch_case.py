"""Fits under ``balance="batch"`` (and ddp, and local steps, to compare with), on 2 ranks through Lightning's
launcher. Each rank writes what a test compares: its whole state, the samples it trained in each epoch (by their
first feature, unique in the blobs), the size of every batch it trained, every step's shares, and the error if the fit
raised.

Usage: python tests/batch_case.py SPEC_JSON OUT_DIR, where SPEC is a list of fits, each a dict:
  name, strategy ("ddp" or OscarsStrategy options), model ("plain": no BatchNorm, "bn", or "frozen": the plain MLP
  with its first layer frozen and an output scale that no optimizer owns), n (samples), epochs,
  batch_size, slow (rank 1's slowdown, 1 = none), max_steps, save_every (steps between checkpoints, written under
  OUT/NAME/ckpt; save_epoch: at every epoch's end), precision, resume (the name of an earlier fit whose last
  checkpoint this one resumes from), accumulate, validate (twice per epoch, metrics logged with sync_dist), csv
  (a CSVLogger).
"""

from __future__ import annotations

import csv
import faulthandler
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from toy import ToyModule, blobs  # noqa: E402

from lightning_oscars import OscarsStrategy  # noqa: E402


class RecordingModule(ToyModule):
    """The toy task, recording the samples each epoch trained; ``plain``: an MLP without BatchNorm (whose steps
    then depend only on the global batch, as ddp's)."""

    def __init__(self, model: str, n: int, batch_size: int, step_cost: float, per_sample: float, slow: float) -> None:
        super().__init__(lr=0.05, step_cost=step_cost, n=n, batch_size=batch_size)
        self.per_sample, self.slow = per_sample, slow
        if model in ("plain", "frozen"):
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        # "frozen": a layer that takes no gradient, and a parameter that takes one but that no optimizer steps
        self.scale = nn.Parameter(torch.ones(4)) if model == "frozen" else None
        if model == "frozen":
            self.net[0].requires_grad_(False)
        self.trained: dict[int, list[float]] = {}
        self.lengths: list[int] = []  # every real batch's size
        self.validations = 0

    def on_validation_end(self) -> None:
        self.validations += 1

    def forward(self, x):
        logits = self.net(x)
        return logits if self.scale is None else logits * self.scale

    def configure_optimizers(self):
        owned = [p for name, p in self.named_parameters() if p.requires_grad and name != "scale"]
        return torch.optim.SGD(owned, lr=self.lr, momentum=0.9)

    def training_step(self, batch, batch_idx):
        self.trained.setdefault(self.current_epoch, []).extend(batch[0][:, 0].tolist())
        x, y = batch
        if len(y):
            self.lengths.append(len(y))
        # A device whose step grows with the batch, rank 1 ``slow`` times slower (emulated in the step itself, so
        # that no wait for another rank is counted as compute).
        factor = self.slow if self.global_rank == 1 else 1.0
        time.sleep((self.step_cost + self.per_sample * len(y)) * factor)
        loss = nn.functional.cross_entropy(self(x), y)
        self.seen += len(y)
        self.steps_taken += 1
        return loss

    def train_dataloader(self):
        return DataLoader(blobs(self.n), batch_size=self.batch_size, shuffle=True)


def strategy_of(spec: dict[str, Any]) -> Any:
    if spec["strategy"] == "ddp":
        return "ddp"
    return OscarsStrategy(**spec["strategy"])


def run_fit(spec: dict[str, Any], out: Path) -> None:
    L.seed_everything(0, verbose=False)
    name = spec["name"]
    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    module = RecordingModule(
        model=spec.get("model", "plain"),
        n=spec.get("n", 512),
        batch_size=spec.get("batch_size", 16),
        step_cost=spec.get("step_cost", 0.002),
        per_sample=spec.get("per_sample", 0.0002),
        slow=float(spec.get("slow", 1)),
    )
    callbacks: list[Any] = []
    if spec.get("save_epoch"):
        callbacks.append(ModelCheckpoint(dirpath=target / "ckpt", every_n_epochs=1, save_top_k=-1))
    if spec.get("save_every"):
        callbacks.append(
            ModelCheckpoint(dirpath=target / "ckpt", every_n_train_steps=spec["save_every"], save_top_k=-1)
        )
    trainer = L.Trainer(
        strategy=strategy_of(spec),
        accelerator="cpu",
        devices=2,
        max_epochs=spec.get("epochs", 2),
        max_steps=spec.get("max_steps", -1),
        accumulate_grad_batches=spec.get("accumulate", 1),
        callbacks=callbacks,
        logger=CSVLogger(target, name="csv") if spec.get("csv") else False,
        enable_checkpointing=bool(spec.get("save_every") or spec.get("save_epoch")),
        precision=spec.get("precision", "32-true"),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(target),
        limit_val_batches=1.0 if spec.get("validate") else 0,
        val_check_interval=0.5 if spec.get("validate") else 1.0,
        num_sanity_val_steps=0,
    )
    ckpt = None
    if spec.get("resume"):
        saved = sorted((out / spec["resume"] / "ckpt").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
        ckpt = str(saved[-1])
    result: dict[str, Any] = {}
    try:
        trainer.fit(module, ckpt_path=ckpt)
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(error).__name__}: {error}"
    strategy = trainer.strategy
    session = getattr(strategy, "batch_session", None)
    result.update(
        rank=trainer.global_rank,
        state={k: v.detach().double().reshape(-1).tolist() for k, v in module.state_dict().items()},
        trained={str(e): rows for e, rows in module.trained.items()},
        lengths=module.lengths,
        dataset_rows=blobs(module.n).tensors[0][:, 0].tolist(),
        steps=[] if session is None else session.steps,
        step_runs=[] if session is None else session.step_runs,
        changes=[] if session is None else session.changes,
        last_batch=None if session is None else list(session._key),  # (epoch, batch) of the fit's last batch
        caps=None if session is None else session.caps,
        global_step=trainer.global_step,
        val_loss=float(trainer.callback_metrics.get("val_loss", float("nan"))),
        validations=module.validations,
    )
    if spec.get("csv") and trainer.global_rank == 0:  # the shares the session logged, as the logger wrote them
        rows = list(csv.DictReader(open(next(target.glob("csv/*/metrics.csv")))))
        result["logged_shares"] = [
            [float(row[f"oscars/share_rank{r}"]) for r in (0, 1)] for row in rows if row.get("oscars/share_rank0")
        ]
    (target / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    specs, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    dump_after = float(os.environ.get("OSCARS_TEST_DUMP_AFTER", "0"))
    if dump_after > 0:
        faulthandler.dump_traceback_later(dump_after, exit=True)
    for spec in specs:
        run_fit(spec, out)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
