"""The parameter-server paradigms' promises, measured black box on 2 ranks, one fit after another in the same two
processes (one launch). Each rank writes what it recorded as JSON.

* ``trajectory``: ``bsp``, rank 1 3x slower, SGD with momentum, a buffer-less MLP, 2 epochs validated twice each:
  every real step records (its clock: the rank's count of real steps in the fit, the round it ran in, the indices
  of its samples); the test recomputes ddp's trajectory from them.
* ``lead/<paradigm>``: ``bsp``, ``ssp(2)`` and ``dssp(1, 2)``, rank 1 5x slower, a model of 2 coordinates in which
  every push of rank ``r`` adds exactly 1 to coordinate ``r`` on the server: every real step records the round it ran
  in and the coordinates it started from, so the test reads how many of the other rank's steps it had seen.

Usage: python tests/lockstep_case.py OUT_DIR. Launched by tests/test_lockstep.py (with a timeout)."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_oscars import BSPStrategy, DSSPStrategy, HeterogeneityEmulator, SSPStrategy  # noqa: E402

SAMPLES, BATCH_SIZE, FEATURES, CLASSES = 128, 4, 6, 3
LR, MOMENTUM = 0.05, 0.9
EPOCHS = 2
STEP_COST_S = 0.004  # emulated compute per step: the emulator's slowdown sleeps in proportion to it
# The slow rank's pacer ends its rounds at this share of the deadline: the ranks' pacers disagree on where a round's
# steps end (as per-rank jitter makes them in practice), here in every round.
SLOW_DEADLINE_SHARE = float(os.environ.get("LOCKSTEP_SLOW_DEADLINE_SHARE", "0.5"))
SSP_STALENESS, DSSP_LOW, DSSP_RANGE = 2, 1, 2
LEAD_PARADIGMS = ("bsp", "ssp", "dssp")
# Both sides of the ddp comparison build the model and draw the data from these.
STRATEGY_OPTIONS: dict[str, Any] = {"warmup_steps": 2, "max_local_steps": 6, "seed": 0}


class IndexedBlobs(Dataset):
    """Gaussian blobs whose items carry their index, so each rank can tell which samples it trained on."""

    def __init__(self, samples: int = SAMPLES, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        centers = torch.randn(CLASSES, FEATURES, generator=g) * 2.0
        self.y = torch.randint(0, CLASSES, (samples,), generator=g)
        self.x = centers[self.y] + torch.randn(samples, FEATURES, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, int]:
        return self.x[index], self.y[index], index


def make_mlp() -> nn.Module:
    """No BatchNorm, no buffers: the server holds the whole model."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, CLASSES))


class Recorded(L.LightningModule):
    """Records every real step: ``(clock, round, sample indices)``; clocks count this rank's real steps in the fit."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_mlp()
        self.steps: list[tuple[int, int, list[int]]] = []
        self.validations = 0

    def on_validation_start(self) -> None:
        self.validations += 1

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y, index = batch
        self.steps.append((len(self.steps), self.trainer.strategy.num_averagings, index.tolist()))  # type: ignore[attr-defined]
        time.sleep(STEP_COST_S)
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedBlobs(), batch_size=BATCH_SIZE, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexedBlobs(16, seed=1), batch_size=8)


class PushCounter(L.LightningModule):
    """Two coordinates; rank ``r``'s step adds 2 to coordinate ``r`` (plain SGD, lr 0.5, loss ``-4 w[r]``), which the
    server applies as ``delta / 2``: coordinate ``r`` counts rank ``r``'s applied pushes, exactly (small integers)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))
        self.seen: list[tuple[int, list[float]]] = []  # (round, the coordinates the step started from)
        self.validations = 0

    def on_validation_start(self) -> None:
        self.validations += 1

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        self.seen.append((self.trainer.strategy.num_averagings, self.w.detach().tolist()))  # type: ignore[attr-defined]
        time.sleep(STEP_COST_S)
        return -4.0 * self.w[self.global_rank]

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_w", self.w.sum(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([self.w], lr=0.5)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedBlobs(), batch_size=BATCH_SIZE, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexedBlobs(16, seed=1), batch_size=8)


class EarlyEndingPacer(L.Callback):
    """Rank 1's deadline pacer gives its rounds :data:`SLOW_DEADLINE_SHARE` of the agreed deadline."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pacer = trainer.strategy.rounds.pacer  # type: ignore[attr-defined]
        if trainer.global_rank != 1 or pacer is None:
            return
        start_round = pacer.start_round

        def shortened(deadline_s: float, step_s: float, quantile_s: float | None = None) -> None:
            start_round(deadline_s * SLOW_DEADLINE_SHARE, step_s, quantile_s)

        pacer.start_round = shortened


def trainer_for(strategy: L.pytorch.strategies.Strategy, slowdown: float, epochs: int) -> L.Trainer:
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        val_check_interval=0.5,
        callbacks=[HeterogeneityEmulator({1: slowdown}), EarlyEndingPacer()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def fit_trajectory() -> dict:
    L.seed_everything(0, verbose=False)
    module = Recorded()
    trainer = trainer_for(BSPStrategy(**STRATEGY_OPTIONS), 3.0, EPOCHS)
    result: dict = {"rank": trainer.global_rank}
    try:
        trainer.fit(module)
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(error).__name__}: {error}"
    result.update(
        weights={k: v.detach().reshape(-1).tolist() for k, v in module.net.state_dict().items()},
        steps=module.steps,
        rounds=trainer.strategy.num_averagings,  # type: ignore[attr-defined]
        validations=module.validations,
    )
    return result


def fit_lead(paradigm: str) -> dict:
    L.seed_everything(0, verbose=False)
    module = PushCounter()
    strategy: L.pytorch.strategies.Strategy
    if paradigm == "bsp":
        strategy = BSPStrategy(**STRATEGY_OPTIONS)
    elif paradigm == "ssp":
        strategy = SSPStrategy(staleness=SSP_STALENESS, **STRATEGY_OPTIONS)
    else:
        strategy = DSSPStrategy(s_low=DSSP_LOW, s_range=DSSP_RANGE, **STRATEGY_OPTIONS)
    trainer = trainer_for(strategy, 5.0, 1)
    result: dict = {"rank": trainer.global_rank}
    try:
        trainer.fit(module)
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(error).__name__}: {error}"
    scheme = trainer.strategy.scheme  # type: ignore[attr-defined]
    reported = scheme.report.get("staleness", []) if scheme is not None else []
    result.update(seen=module.seen, final=module.w.detach().tolist(), validations=module.validations)
    result["reported"] = reported  # the staleness of every open grant of this rank's shard, as benchmarks report it
    return result


def main() -> None:
    out = Path(sys.argv[1])
    dump_after = float(os.environ.get("OSCARS_TEST_DUMP_AFTER", "0"))
    if dump_after > 0:  # a hang prints every rank's stack (to the test's log) and exits instead of waiting
        faulthandler.dump_traceback_later(dump_after, exit=True)
    results: dict[str, dict] = {"trajectory": fit_trajectory()}
    for paradigm in LEAD_PARADIGMS:
        results[f"lead/{paradigm}"] = fit_lead(paradigm)
    rank = results["trajectory"]["rank"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
