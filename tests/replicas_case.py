"""Replica groups on 4 ranks as 2 replicas of 2 (ranks 2-3 3x slower), several fits in the same four processes (one
launch). After every real step each rank records a digest of its weights; each rank writes what it trained on and
ended with as JSON.

Usage: python tests/replicas_case.py OUT_DIR. Launched by tests/test_replicas.py (with a timeout)."""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from paradigm_models_case import IndexedBlobs, make_net  # noqa: E402 - the same data and models
from torch import Tensor, nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_oscars  # noqa: E402 - registers the strategies by name
from lightning_oscars import HeterogeneityEmulator  # noqa: E402

# 65 samples in replica batches of 2 x 4: the last batch's single leftover sample joins the one before it.
SAMPLES, BATCH_SIZE = 65, 4
STEP_COST_S = 0.004  # emulated compute per step: the emulator's 3x sleeps in proportion to it
SLOWER = {2: 3.0, 3: 3.0}  # the second replica
# name -> (model, strategy options, Trainer options)
FITS: dict[str, tuple[str, dict, dict]] = {
    "mlp": ("mlp", {"replica_size": 2}, {"max_epochs": 2, "limit_val_batches": 1.0}),
    "batchnorm_accumulate": ("batchnorm", {"replica_size": 2}, {"max_epochs": 1, "accumulate_grad_batches": 2}),
    "frozen_local_sgd": ("frozen", {"replica_size": 2, "solver": "uniform", "max_local_steps": 3}, {"max_epochs": 1}),
    # a batch size per replica (its ranks agree): replica 0 on 12 per rank, replica 1 on 4
    "replica_sizes": ("mlp", {"replica_size": 2, "batch_sizes": [12, 12, 4, 4]}, {"max_epochs": 1}),
}


def digest(module: nn.Module, buffers: bool = True) -> str:
    """The module's parameters (and buffers), bit for bit."""
    h = hashlib.sha1()
    for tensor in module.state_dict().values() if buffers else module.parameters():
        if isinstance(tensor, DTensor):  # a sharded parameter: the whole of it (gathered inside the replica)
            tensor = tensor.full_tensor()
        # a copy: a NumPy view of a parameter FSDP2 holds gathered would keep it from freeing it (torch refuses to
        # resize a storage NumPy shares)
        h.update(tensor.detach().float().cpu().clone(memory_format=torch.contiguous_format).numpy().tobytes())
    return h.hexdigest()


class IndexedModule(L.LightningModule):
    def __init__(self, model: str) -> None:
        super().__init__()
        self.net = make_net(model)
        self.trained: dict[int, list[int]] = {}  # epoch -> indices of the samples this rank trained on
        self.lengths: list[int] = []  # every real batch's size
        # global step -> digest of the parameters after it (real steps only). Not the buffers: DDP makes a replica's
        # buffers its first rank's at the start of each forward, and each rank's BatchNorm then updates its own.
        self.after_step: dict[int, str] = {}
        self.wrapped = ""  # the type of the model the strategy trains
        self.validated = 0

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y, index = batch
        self.trained.setdefault(self.current_epoch, []).extend(index.tolist())
        if len(index):
            self.lengths.append(len(index))
        time.sleep(STEP_COST_S)
        return nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        if getattr(self.trainer.strategy, "slot_is_real", True):  # every slot is a step under other strategies
            self.after_step[self.trainer.global_step] = digest(self.net, buffers=False)

    def on_train_start(self) -> None:
        self.wrapped = type(self.trainer.strategy.model).__name__

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        x, y, _ = batch
        self.validated += len(y)
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedBlobs(SAMPLES), batch_size=BATCH_SIZE, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexedBlobs(16), batch_size=BATCH_SIZE)


def trainer(
    options: dict, trainer_options: dict, callbacks: list | None = None, slower: dict[int, float] = SLOWER
) -> L.Trainer:
    return L.Trainer(
        strategy=lightning_oscars.OscarsStrategy(**options),
        accelerator="cpu",
        devices=4,
        callbacks=[HeterogeneityEmulator(slower), *(callbacks or [])],
        logger=False,
        enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks or []),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **{"limit_val_batches": 0, **trainer_options},
    )


def outcome(module: IndexedModule, fitted: L.Trainer) -> dict:
    strategy = fitted.strategy
    return {
        "rank": fitted.global_rank,
        "replica": strategy.layout.replica_of(fitted.global_rank),
        "wrapped": module.wrapped,
        "weights": digest(module.net),
        "after_step": {str(step): d for step, d in module.after_step.items()},
        "trained": {str(epoch): indices for epoch, indices in module.trained.items()},
        "lengths": module.lengths,
        "validated": module.validated,
        "local_steps": [list(r.local_steps) for r in strategy.history],
        "samples": [list(r.samples) for r in strategy.history],
        "global_step": fitted.global_step,
    }


def fit_one(name: str) -> dict:
    model, options, trainer_options = FITS[name]
    L.seed_everything(0, verbose=False)
    module = IndexedModule(model)
    frozen_before = [p.detach().clone() for p in module.parameters() if not p.requires_grad]
    fitted = trainer(options, trainer_options)
    fitted.fit(module)
    result = outcome(module, fitted)
    result["frozen_kept"] = all(
        torch.equal(a, b) for a, b in zip(frozen_before, (p for p in module.parameters() if not p.requires_grad))
    )
    return result


class StopOnRank(L.Callback):
    """Rank ``rank`` asks the trainer to stop after its ``after``-th real step (as EarlyStopping would, locally)."""

    def __init__(self, rank: int, after: int) -> None:
        self.rank, self.after, self.steps = rank, after, 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_rank == self.rank and trainer.strategy.slot_is_real:
            self.steps += 1
            if self.steps == self.after:
                trainer.should_stop = True


def stop_from_one_rank() -> dict:
    """The second replica's second rank asks to stop in the first round (the warm-up, the whole first epoch here):
    every rank stops at that round's boundary."""
    L.seed_everything(0, verbose=False)
    module = IndexedModule("mlp")
    fitted = trainer({"replica_size": 2}, {"max_epochs": 2}, [StopOnRank(3, after=2)])
    fitted.fit(module)
    return {**outcome(module, fitted), "epoch": fitted.current_epoch}


def resume_across_layouts(out: Path, first: int, then: int) -> dict:
    """One epoch with ``replica_size=first`` saving ``last.ckpt``, then a second epoch resumed from it with
    ``replica_size=then``."""
    return resume_between(out / f"layouts_{first}_{then}", {"replica_size": first}, {"replica_size": then})


def resume_between(
    checkpoints: Path, first: dict, then: dict, make: Any = IndexedModule, report: Any = outcome
) -> dict:
    """One epoch under the strategy options ``first`` saving ``last.ckpt``, then a second resumed from it under
    ``then``; ``report(module, trainer)`` of the second (``make("mlp")`` builds the module)."""
    result: dict = {}
    for epochs, options in ((1, first), (2, then)):
        L.seed_everything(0, verbose=False)
        module = make("mlp")
        saving = L.pytorch.callbacks.ModelCheckpoint(checkpoints, save_last=True)
        fitted = trainer(options, {"max_epochs": epochs}, [saving])
        fitted.fit(module, ckpt_path=str(checkpoints / "last.ckpt") if epochs == 2 else None)
        result = report(module, fitted)
    return result


def main() -> None:
    out = Path(sys.argv[1])
    dump_after = float(os.environ.get("OSCARS_TEST_DUMP_AFTER", "0"))
    if dump_after > 0:  # a hang prints every rank's stack (to the test's log) and exits instead of waiting
        faulthandler.dump_traceback_later(dump_after, exit=True)
    results: dict[str, dict] = {}
    for name in FITS:
        results[name] = fit_one(name)
    results["stop_from_rank3"] = stop_from_one_rank()
    results["resume_2_then_1"] = resume_across_layouts(out, 2, 1)
    results["resume_1_then_2"] = resume_across_layouts(out, 1, 2)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{results['mlp']['rank']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
