"""Every strategy of the package fits three kinds of model on 2 ranks, rank 1 3x slower, one fit after another in
the same two processes (one launch): a buffer-less MLP, an MLP with BatchNorm and an MLP whose first layer is
frozen. Each rank writes what it ended with as JSON.

Usage: python tests/paradigm_models_case.py OUT_DIR. Launched by tests/test_paradigm_models.py (with a timeout)."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import lightning_oscars  # noqa: E402 - registers the strategies by name
from lightning_oscars import HeterogeneityEmulator  # noqa: E402

# ``ssp+server_momentum``: ssp with the momentum on the server and plain SGD on the workers.
STRATEGIES = (
    *("oscars", "oscars_alg1", "local_sgd", "bsp", "asp", "ssp", "dssp", "dasp", "ripples"),
    "ssp+server_momentum",
)
MODELS = ("mlp", "batchnorm", "frozen")
SAMPLES, BATCH_SIZE, FEATURES, CLASSES = 64, 4, 6, 3
STEP_COST_S = 0.004  # emulated compute per step: the emulator's 3x sleeps in proportion to it


class IndexedBlobs(Dataset):
    """Gaussian blobs whose items carry their index, so each rank can tell which samples it trained on."""

    def __init__(self, samples: int = SAMPLES) -> None:
        g = torch.Generator().manual_seed(0)
        centers = torch.randn(CLASSES, FEATURES, generator=g) * 2.0
        self.y = torch.randint(0, CLASSES, (samples,), generator=g)
        self.x = centers[self.y] + torch.randn(samples, FEATURES, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, int]:
        return self.x[index], self.y[index], index


def make_net(model: str) -> nn.Module:
    if model == "batchnorm":
        return nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, CLASSES))
    net = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, CLASSES))
    if model == "frozen":
        net[0].requires_grad_(False)
    return net


class IndexedModule(L.LightningModule):
    def __init__(self, model: str, momentum: float = 0.9) -> None:
        super().__init__()
        self.momentum = momentum
        self.net = make_net(model)
        self.trained: dict[int, list[int]] = {}  # epoch -> indices of the samples this rank trained on

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y, index = batch
        self.trained.setdefault(self.current_epoch, []).extend(index.tolist())
        time.sleep(STEP_COST_S)
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=self.momentum)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedBlobs(), batch_size=BATCH_SIZE, shuffle=True)


class ServerVelocity(L.Callback):
    """The servers' momentum buffer as the strategy would checkpoint it, at the end of training."""

    def __init__(self) -> None:
        self.velocity: list[float] | None = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        velocity = trainer.strategy.state_dict().get("scheme", {}).get("server_velocity")
        self.velocity = None if velocity is None else velocity.tolist()


class VelocityAtResume(L.Callback):
    """At the first batch of a resumed fit: whether this rank's server shard holds the checkpoint's momentum buffer."""

    def __init__(self, checkpoint: Path) -> None:
        self.saved = torch.load(checkpoint, weights_only=False)["oscars"]["scheme"]["server_velocity"]
        self.matches: bool | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if self.matches is None:
            server = trainer.strategy.scheme.server
            start, end = server.bounds[trainer.global_rank]
            self.matches = bool(torch.equal(server.shard.velocity_copy(), self.saved[start:end]))


def resume_server_momentum(out: Path) -> dict:
    """ssp with server momentum: one epoch saving ``last.ckpt``, then a second fit resumed from it."""
    checkpoints = out / "server_momentum_ckpt"
    for epochs, resume in ((1, False), (2, True)):
        L.seed_everything(0, verbose=False)
        module = IndexedModule("mlp", momentum=0.0)
        at_resume = VelocityAtResume(checkpoints / "last.ckpt") if resume else None
        saving = L.pytorch.callbacks.ModelCheckpoint(checkpoints, save_last=True)
        trainer = L.Trainer(
            strategy=lightning_oscars.SSPStrategy(server_momentum=0.9),
            accelerator="cpu",
            devices=2,
            max_epochs=epochs,
            callbacks=[HeterogeneityEmulator({1: 3.0}), saving] + ([at_resume] if at_resume else []),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(module, ckpt_path=str(checkpoints / "last.ckpt") if resume else None)
    assert at_resume is not None
    return {"velocity_resumed": at_resume.matches, "saved_nonzero": bool(at_resume.saved.abs().sum() > 0)}


def fit_one(name: str, model: str) -> dict:
    L.seed_everything(0, verbose=False)
    server_momentum = name.endswith("+server_momentum")
    strategy: str | L.pytorch.strategies.Strategy = name
    if server_momentum:
        strategy = lightning_oscars.SSPStrategy(server_momentum=0.9)
    module = IndexedModule(model, momentum=0.0 if server_momentum else 0.9)
    velocity = ServerVelocity()
    frozen_before = [p.detach().clone() for p in module.parameters() if not p.requires_grad]
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        callbacks=[HeterogeneityEmulator({1: 3.0}), velocity],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    result: dict = {"rank": trainer.global_rank}
    try:
        trainer.fit(module)
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(error).__name__}: {error}"
    frozen_after = [p.detach() for p in module.parameters() if not p.requires_grad]
    result.update(
        weights=torch.cat([t.detach().float().reshape(-1) for t in module.state_dict().values()]).tolist(),
        trained={str(epoch): indices for epoch, indices in module.trained.items()},
        frozen_kept=all(torch.equal(a, b) for a, b in zip(frozen_before, frozen_after)),
        global_step=trainer.global_step,
        server_velocity=velocity.velocity,
        trainable=sum(p.numel() for p in module.parameters() if p.requires_grad),
    )
    return result


def main() -> None:
    out = Path(sys.argv[1])
    dump_after = float(os.environ.get("OSCARS_TEST_DUMP_AFTER", "0"))
    if dump_after > 0:  # a hang prints every rank's stack (to the test's log) and exits instead of waiting
        faulthandler.dump_traceback_later(dump_after, exit=True)
    results: dict[str, dict] = {}
    rank = 0
    for strategy in STRATEGIES:
        for model in MODELS:
            result = results[f"{strategy}/{model}"] = fit_one(strategy, model)
            rank = result["rank"]
    results["resume"] = resume_server_momentum(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
