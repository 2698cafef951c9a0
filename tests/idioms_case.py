"""Research idioms whose state lives outside the optimizer's parameters (issue 46's third ring), on 2 ranks through
Lightning's launcher, rank 1 three times slower and ``warmup_steps=1`` so that the ranks take unequal local steps
inside a short fit. Each case writes, per rank, the whole state a test compares between the ranks and with ddp.

Usage: python tests/idioms_case.py STRATEGY CASE[+CASE...] OUT_DIR   (STRATEGY: oscars or ddp)
"""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402
from lightning.pytorch.callbacks import ModelPruning, SpikeDetection  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.utils import parametrizations  # noqa: E402
from toy import ToyModule  # noqa: E402

from lightning_oscars import HeterogeneityEmulator, OscarsStrategy  # noqa: E402


class PruningModule(ToyModule):
    """ModelPruning's target: the plain MLP (BatchNorm included)."""


class MaskProbe(Callback):
    """Each pruning mask after every epoch's pruning: its zeros, and whether it holds only 0 and 1."""

    def __init__(self) -> None:
        self.masks: list[dict[str, list]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        masks = {k: v for k, v in pl_module.state_dict().items() if k.endswith("_mask")}
        self.masks.append({k: [int((v == 0).sum()), bool(((v == 0) | (v == 1)).all())] for k, v in masks.items()})


class EMACallback(Callback):
    """A user's EMA of the module's state, updated after every batch and kept in the callback's ``state_dict``, as
    diffusion and vision code does (not Lightning's ``WeightAveraging``)."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.ema: dict[str, torch.Tensor] | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.ema = {k: v.detach().clone().float() for k, v in pl_module.state_dict().items()}

    @torch.no_grad()
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        assert self.ema is not None
        for key, value in pl_module.state_dict().items():
            self.ema[key].mul_(self.decay).add_(value.float(), alpha=1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.ema}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.ema = state_dict["ema"]


class TeacherModule(ToyModule):
    """A momentum teacher (BYOL, MoCo, DINO): a frozen copy of the student moved towards it in ``training_step``;
    the loss pulls the student's output towards the teacher's."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.teacher = copy.deepcopy(self.net)
        for p in self.teacher.parameters():
            p.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.net.parameters()):
                t.data.mul_(0.9).add_(s.data, alpha=0.1)  # the .data idiom most such code uses
            target = self.teacher(x).softmax(-1)
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y) + 0.1 * nn.functional.cross_entropy(logits, target)
        self.seen += len(y)
        self.steps_taken += 1
        return loss


class CenteredLoss(nn.Module):
    """DINO's loss as self-supervised libraries write it: a center buffer updated from the teacher's outputs,
    all-reduced over the world on every step."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("center", torch.zeros(1, dim))

    def forward(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        target = ((teacher - self.center) / 0.5).softmax(-1)
        loss = -(target * student.log_softmax(-1)).sum(-1).mean()
        self.update_center(teacher)
        return loss

    @torch.no_grad()
    def update_center(self, teacher: torch.Tensor) -> None:
        batch_center = teacher.sum(0, keepdim=True)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(batch_center)
            batch_center = batch_center / dist.get_world_size()
        batch_center = batch_center / len(teacher)
        self.center.mul_(0.9).add_(batch_center, alpha=0.1)


class DinoModule(TeacherModule):
    """A momentum teacher and a loss that all-reduces its center buffer inside every training step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.criterion = CenteredLoss(4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.net.parameters()):
                t.mul_(0.9).add_(s, alpha=0.1)
            teacher = self.teacher(x)
        loss = self.criterion(self(x), teacher) + nn.functional.cross_entropy(self(x), y)
        self.seen += len(y)
        self.steps_taken += 1
        return loss


class SpectralModule(ToyModule):
    """Parametrized weights: spectral norm on the first layer (power-iteration buffers ``_u``, ``_v``), weight norm
    on the last (two parameters, ``original0`` and ``original1``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        parametrizations.spectral_norm(self.net[0])
        parametrizations.weight_norm(self.net[3])


class GatherModule(ToyModule):
    """Lightning's own idiom: each rank lists the samples it trained, gathered with ``self.all_gather`` at the end."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trained_rows: list[torch.Tensor] = []
        self.gathered: list[float] | None = None
        self.tensor_error = ""

    def training_step(self, batch, batch_idx):
        self.trained_rows.append(batch[0][:, 0].detach())
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        gathered = self.all_gather(self.trained_rows)  # a list as long as the batches this rank trained
        self.gathered = torch.cat(gathered).reshape(-1).tolist()
        try:  # one tensor of different lengths cannot be stacked: a clear error on every rank
            self.all_gather(torch.cat(self.trained_rows))
        except RuntimeError as error:
            self.tensor_error = str(error)


def build(case: str) -> tuple[L.LightningModule, list[Callback]]:
    if case == "pruning":
        prune = ModelPruning("l1_unstructured", amount=0.25, make_pruning_permanent=True, verbose=0)
        return PruningModule(step_cost=0.004), [prune, MaskProbe()]
    if case == "ema_callback":
        return ToyModule(step_cost=0.004), [EMACallback()]
    if case == "teacher":
        return TeacherModule(step_cost=0.004), []
    if case == "dino":
        return DinoModule(step_cost=0.004), []
    if case == "spectral":
        return SpectralModule(step_cost=0.004), []
    if case == "spike":
        return ToyModule(step_cost=0.004), [SpikeDetection(rtol=1e6)]  # a spike would stop both ways alike
    if case == "gather":
        return GatherModule(step_cost=0.004), []
    raise SystemExit(f"unknown case {case}")


def state_of(module: nn.Module) -> dict[str, list[float]]:
    return {k: v.detach().double().reshape(-1).tolist() for k, v in module.state_dict().items()}


def run_one(strategy_name: str, case: str, out: Path) -> None:
    L.seed_everything(0, verbose=False)
    module, callbacks = build(case)
    strategy: Any = OscarsStrategy(warmup_steps=1) if strategy_name == "oscars" else "ddp"
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=3,
        callbacks=[*callbacks, HeterogeneityEmulator({1: 3.0})],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        limit_val_batches=0,
    )
    result: dict[str, Any] = {}
    try:
        trainer.fit(module)
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(error).__name__}: {error}"
    result.update(rank=trainer.global_rank, state=state_of(module), steps_taken=module.steps_taken)
    for cb in callbacks:
        if isinstance(cb, MaskProbe):
            result["masks"] = cb.masks
        if isinstance(cb, EMACallback) and cb.ema is not None:
            result["ema"] = {k: v.reshape(-1).tolist() for k, v in cb.ema.items()}
    if isinstance(module, SpectralModule):
        with torch.no_grad():
            result["sigma"] = float(torch.linalg.matrix_norm(module.net[0].weight, ord=2))
            sn = module.net[0].parametrizations.weight[0]
            result["u_norm"], result["v_norm"] = float(sn._u.norm()), float(sn._v.norm())
    if isinstance(module, PruningModule):
        result["zeros"] = {k: int((v == 0).sum()) for k, v in module.state_dict().items() if k.endswith("weight")}
    if isinstance(module, GatherModule):
        result["gathered"] = module.gathered
        result["trained_rows"] = torch.cat(module.trained_rows).tolist()
        result["tensor_error"] = module.tensor_error
        result["dataset_rows"] = module.train_dataloader().dataset.tensors[0][:, 0].tolist()
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    strategy_name, cases, out = sys.argv[1], sys.argv[2].split("+"), Path(sys.argv[3])
    dump_after = float(os.environ.get("OSCARS_TEST_DUMP_AFTER", "0"))
    if dump_after > 0:
        faulthandler.dump_traceback_later(dump_after, exit=True)
    for case in cases:
        target = out / case
        target.mkdir(parents=True, exist_ok=True)
        run_one(strategy_name, case, target)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
