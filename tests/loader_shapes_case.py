"""Loaders and models in the shape real Lightning libraries give them (issue 56), on 2 ranks through Lightning's
launcher, rank 1 three times slower and ``warmup_steps=1`` so that the ranks take unequal local steps, in either
Lightning namespace. Each case writes, per rank, its whole state and the sample ids it trained in each epoch.

Usage: python tests/loader_shapes_case.py NAMESPACE CASE[+CASE...] OUT_DIR
  NAMESPACE: lightning.pytorch or pytorch_lightning (the Trainer, module and callbacks all come from it)
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.utils.parametrize
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))
from loader_shapes_data import BatchesOfShard, LengthBuckets  # noqa: E402

NAMESPACE = sys.argv[1] if len(sys.argv) > 1 else "lightning.pytorch"
pl: Any = importlib.import_module(NAMESPACE)
oscars: Any = importlib.import_module(
    "lightning_oscars" if NAMESPACE == "lightning.pytorch" else "lightning_oscars.pytorch_lightning"
)
N = 45  # an epoch's last batch of 8 is short
WINDOWS_PER_PASS = 10


class Ids(Dataset):
    """Sample ``i``: features whose first column is ``i`` (so that a rank can say what it trained) and a label.
    Indexed by a list (``batch_size=None`` over a batch sampler) it returns those rows at once."""

    def __init__(self, n: int = N) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.x[:, 0] = torch.arange(n, dtype=torch.float32)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


class ZipLoader(DataLoader):
    """A loader subclass over two loaders whose own ``__iter__`` zips them (semi-supervised loaders of single-cell
    tools: a labelled and an unlabelled batch per step), both shuffled from torch's global generator."""

    def __init__(self) -> None:
        self.labelled = DataLoader(Ids(), batch_size=5, shuffle=True)
        self.unlabelled = DataLoader(Ids(), batch_size=5, shuffle=True)
        super().__init__(self.labelled)  # its dataset is a loader, as such libraries build it

    def __iter__(self):
        return zip(self.labelled, self.unlabelled)

    def __len__(self) -> int:
        return len(self.labelled)


class RandomWindows:
    """A forecasting library's training data as it reaches Lightning: not a DataLoader but a plain iterable of ready
    batches, an endless source of random windows cut to ``per_pass`` batches per pass (its length), drawn from this
    rank's own generator (as each ddp rank draws from its own copy)."""

    def __init__(self, per_pass: int, rank: int) -> None:
        self.per_pass, self.passes, self.data = per_pass, 0, Ids()
        self.generator = torch.Generator().manual_seed(100 + rank)

    def __len__(self) -> int:
        return self.per_pass

    def __iter__(self):
        self.passes += 1
        for _ in range(self.per_pass):
            rows = torch.randint(0, N, (8,), generator=self.generator)
            yield self.data.x[rows], self.data.y[rows]


class MissingOnRank1(Ids):
    """A data set whose file one node lacks: its length fails on rank 1 alone."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def __len__(self) -> int:
        if self.rank == 1:
            raise FileNotFoundError("/data/train-part-1.npy is missing on this node")
        return super().__len__()


class ChecksShardsAtEpochStart(SequentialSampler):
    """A library's sampler that checks the epoch's shard files in ``set_epoch``: one is missing on rank 1."""

    def __init__(self, data: Any, rank: int) -> None:
        super().__init__(data)
        self.rank = rank

    def set_epoch(self, epoch: int) -> None:
        if epoch == 1 and self.rank == 1:
            raise FileNotFoundError("shard-000001.tar of epoch 1 is missing on this node")


class CheckedZipLoader(ZipLoader):
    """:class:`ZipLoader` whose own sampler is told each epoch (``ChecksShardsAtEpochStart``)."""

    def __init__(self, rank: int) -> None:
        self.labelled = DataLoader(Ids(), batch_size=5, shuffle=True)
        self.unlabelled = DataLoader(Ids(), batch_size=5, shuffle=True)
        DataLoader.__init__(self, self.labelled, sampler=ChecksShardsAtEpochStart(self.labelled, rank))


class FailsAtEpoch1(Sampler):
    """A custom sampler that cannot draw the second epoch (only rank 0 draws a custom sampler's epoch)."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if self.epoch == 1:
            raise ValueError("this sampler cannot draw epoch 1")
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def forward_in_a_server(module: nn.Module, inputs: torch.Tensor, queue: Any) -> None:
    """What a serving check does with the module in a process of its own: unpickle it, run it."""
    module.eval()
    with torch.no_grad():
        queue.put(module(inputs).tolist())


class ServesOnRankZero(pl.Callback):
    """A callback acting on rank 0 alone at the start and end of training (as ``ServableModuleValidator``): the module,
    detached from its trainer, is pickled into a spawned process that runs it; the outputs there and here are kept."""

    def __init__(self) -> None:
        self.outputs: list[tuple[list, list]] = []

    def _serve(self, trainer, module) -> None:
        if trainer.global_rank != 0:
            return
        context = torch.multiprocessing.get_context("spawn")
        queue, inputs = context.Queue(), torch.ones(2, 8)
        module.trainer = None  # as ServableModuleValidator does before it starts its server
        process = context.Process(target=forward_in_a_server, args=(module, inputs, queue))
        process.start()
        module.trainer = trainer
        served = queue.get(timeout=60)
        process.join(timeout=60)
        was_training = module.training
        module.eval()
        with torch.no_grad():
            here = module(inputs).tolist()
        module.train(was_training)
        self.outputs.append((served, here))

    def on_train_start(self, trainer, pl_module) -> None:
        self._serve(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._serve(trainer, pl_module)


def _combined_loader(case: str) -> Any:
    """Multi-task training: a dict (or list) of training loaders of different lengths, in one of CombinedLoader's
    modes: ``a`` has 6 batches an epoch, ``b`` 4 (its sample ids start at 1000)."""
    a = DataLoader(Ids(), batch_size=8, shuffle=True)
    second = Ids(20)
    second.x[:, 0] += 1000
    b = DataLoader(second, batch_size=5, shuffle=True)
    kind, mode = case.split("_", 1)
    loaders: Any = {"a": a, "b": b} if kind == "dict" else [a, b]
    if mode == "max_size_cycle":  # Lightning's default for training
        return loaders
    from importlib import import_module

    return import_module(f"{NAMESPACE}.utilities").CombinedLoader(loaders, mode)


class Model(pl.LightningModule):
    """An MLP with BatchNorm that records the sample ids it trained, epoch by epoch."""

    def __init__(self, loader: str = "plain") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        self.loader = loader
        self.trained: list[list[int]] = []
        self.trained_steps: list[tuple[int, list[int]]] = []  # (global step, sample ids) of every real step
        self.steps_taken = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_epoch_start(self) -> None:
        self.trained.append([])

    def _record(self, x: torch.Tensor) -> None:
        if not self.trained:  # resumed mid-epoch: Lightning does not call on_train_epoch_start again
            self.trained.append([])
        ids = x[:, 0].long().tolist()
        self.trained[-1] += ids
        self.trained_steps.append((self.trainer.global_step, ids))

    def training_step(self, batch, batch_idx):
        if self.loader.startswith(("dict_", "list_")):  # one batch of each loader (None: one past its end)
            parts = [p for p in (batch.values() if isinstance(batch, dict) else batch) if p is not None]
            loss = 0.0
            for x, y in parts:
                if len(y):
                    self._record(x)
                    loss = loss + nn.functional.cross_entropy(self(x), y)
            self.steps_taken += int(any(len(y) for _, y in parts))
            return loss if isinstance(loss, torch.Tensor) else sum(self(x).sum() * 0 for x, _ in parts)
        if self.loader in ("zip", "set_epoch_fails"):  # the labelled half is trained and counted, the other passes
            (x, y), (unlabelled, _) = batch
            extra = 0.0 * self(unlabelled).sum() if len(unlabelled) else 0.0
            if len(y):
                self._record(x)
                self.steps_taken += 1
            return nn.functional.cross_entropy(self(x), y) + extra
        x, y = batch
        if len(y):
            self._record(x)
            self.steps_taken += 1
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        data = Ids()
        if self.loader == "buckets":
            return DataLoader(data, batch_sampler=LengthBuckets(N, 4))
        if self.loader == "batch_none":
            return DataLoader(data, batch_size=None, sampler=BatchSampler(RandomSampler(data), 5, drop_last=False))
        if self.loader == "dist_subclass":
            world, rank = self.trainer.world_size, self.trainer.global_rank
            sampler = BatchesOfShard(data, 5, num_replicas=world, rank=rank, shuffle=True, seed=1)
            return DataLoader(data, batch_size=None, sampler=sampler)
        if self.loader == "zip":
            return ZipLoader()
        if self.loader.startswith(("dict_", "list_")):
            return _combined_loader(self.loader)
        if self.loader == "draw_fails":
            return DataLoader(data, batch_size=8, sampler=FailsAtEpoch1(N))
        rank = self.trainer.global_rank
        if self.loader == "build_fails":
            return DataLoader(MissingOnRank1(rank), batch_size=8, shuffle=True)
        if self.loader == "size_differs":  # a node whose copy of the data set is shorter
            return DataLoader(Ids(N - 5 * rank), batch_size=8, shuffle=True)
        if self.loader == "set_epoch_fails":
            return CheckedZipLoader(rank)
        if self.loader == "own_windows":
            self.windows = RandomWindows(WINDOWS_PER_PASS, rank)
            return self.windows
        return DataLoader(data, batch_size=8, shuffle=True)


class MaskedAttention(Model):
    """Forecasting models' idiom (a temporal fusion transformer's masks): non-persistent buffers rebuilt for each
    batch size, so the rank that trains an epoch's short last batch holds smaller ones."""

    def __init__(self, persistent: bool = False) -> None:
        super().__init__()
        self.persistent = persistent
        self.register_buffer("attention_mask", torch.ones(8, 8), persistent=persistent)
        self.register_buffer("relative_index", torch.arange(8), persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.attention_mask.shape[0] != len(x):  # rebuilt for this batch size
            self.attention_mask = torch.tril(torch.ones(len(x), len(x)))
            self.relative_index = torch.arange(len(x))
        mixed = (self.attention_mask / self.attention_mask.sum(1, keepdim=True).clamp(min=1)) @ x
        return self.net(x + 0.1 * mixed)


class Scaled(nn.Module):
    """A weight parametrization (as weight normalisation and spectral norms are): the weight is computed."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 0.5 * weight


class UserShapes(Model):
    """The model shapes a tool's own examples have besides a plain MLP: no buffers at all, a frozen layer, a parameter
    no optimizer owns (it gets gradients, no step), a parametrized weight; validated twice per epoch."""

    def __init__(self, loader: str) -> None:
        super().__init__(loader=loader)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        torch.nn.utils.parametrize.register_parametrization(self.net[0], "weight", Scaled())
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.temperature = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x + 0.1 * self.frozen(x)) * self.temperature

    def configure_optimizers(self):
        owned = [p for name, p in self.named_parameters() if p.requires_grad and name != "temperature"]
        return torch.optim.Adam(owned, lr=0.01)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def val_dataloader(self):
        return DataLoader(Ids(16), batch_size=8)


def build(case: str) -> pl.LightningModule:
    if case.startswith("shapes:"):
        return UserShapes(loader=case.split(":", 1)[1])
    if case.startswith("resume:"):
        return Model(loader=case.split(":", 1)[1])
    more = ("draw_fails", "build_fails", "size_differs", "set_epoch_fails", "own_windows")
    if case in ("plain", "buckets", "batch_none", "dist_subclass", "zip", "servable", *more) or case.startswith(
        ("dict_", "list_")
    ):
        return Model(loader=case)
    if case == "masks":
        return MaskedAttention()
    if case == "persistent_masks":
        return MaskedAttention(persistent=True)
    raise SystemExit(f"unknown case {case}")


def state_of(module: nn.Module) -> dict[str, list[float]]:
    return {k: v.detach().double().reshape(-1).tolist() for k, v in module.state_dict().items()}


def run_one(
    case: str, strategy: Any, out: Path, *, slow: bool = True, ckpt: str | None = None, name: str = "rank", **kw: Any
) -> None:
    pl.seed_everything(0, verbose=False)
    module = build(case)
    served = ServesOnRankZero() if case == "servable" else None
    settings: dict[str, Any] = dict(enable_checkpointing=False, limit_val_batches=0, max_epochs=3)
    settings.update(kw)
    emulate = [oscars.HeterogeneityEmulator({1: 3.0})] if slow else []
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        callbacks=[*emulate, *([served] if served else []), *settings.pop("callbacks", [])],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        **settings,
    )
    result: dict[str, Any] = {
        "strategy_class": f"{type(trainer.strategy).__module__}.{type(trainer.strategy).__name__}"
    }
    initial = state_of(module)
    try:
        trainer.fit(module, ckpt_path=ckpt)
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["failed_at"] = time.time()
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc()
    result.update(rank=trainer.global_rank, state=state_of(module), trained=module.trained, steps=module.steps_taken)
    result.update(initial=initial, trained_steps=module.trained_steps, global_step=trainer.global_step)
    result["buffers"] = {k: list(v.shape) for k, v in module.named_buffers()}
    result["served"] = served.outputs if served is not None else None
    result["passes"] = module.windows.passes if hasattr(module, "windows") else None
    checkpoints = [c for c in trainer.callbacks if isinstance(c, pl.callbacks.ModelCheckpoint)]  # type: ignore[attr-defined]
    result["checkpoint_state"] = [repr(sorted(c.state_dict().items())) for c in checkpoints]
    result["val_loss"] = float(trainer.callback_metrics["val_loss"]) if "val_loss" in trainer.callback_metrics else None
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}{trainer.global_rank}.json").write_text(json.dumps(result))


def resume_pair(case: str, out: Path) -> None:
    """A fit that checkpoints every 3 steps (``first_rank*.json``), then one resumed from its checkpoint at step 3, in
    the middle of the first epoch (``rank*.json``)."""
    strategy = oscars.OscarsStrategy(warmup_steps=1)
    every = pl.callbacks.ModelCheckpoint(dirpath=out / "steps", every_n_train_steps=3, save_top_k=-1)
    run_one(case, strategy, out, enable_checkpointing=True, callbacks=[every], max_epochs=2, name="first_rank")
    resumed = pl.callbacks.ModelCheckpoint(dirpath=out / "resumed", every_n_train_steps=3, save_top_k=-1)
    ckpt = str(out / "steps" / "epoch=0-step=3.ckpt")
    strategy = oscars.OscarsStrategy(warmup_steps=1)
    run_one(case, strategy, out, enable_checkpointing=True, callbacks=[resumed], max_epochs=2, ckpt=ckpt)


def main() -> None:
    cases, out = sys.argv[2].split("+"), Path(sys.argv[3])
    dump_after = float(os.environ.get("OSCARS_TEST_DUMP_AFTER", "0"))
    if dump_after > 0:
        faulthandler.dump_traceback_later(dump_after, exit=True)
    for case in cases:
        if case.startswith("name:"):  # a registered strategy name, on the plain loader
            run_one("plain", case.split(":", 1)[1], out / case.replace(":", "_"))
        elif case == "object_of_lightning":  # an OscarsStrategy made from the lightning.pytorch-bound package
            import lightning_oscars

            run_one("plain", lightning_oscars.OscarsStrategy(warmup_steps=1), out / case)
        elif case.startswith("resume:"):
            resume_pair(case, out / case.replace(":", "_"))
        elif case.startswith("shapes:"):  # equal speeds, validation twice per epoch
            strategy = oscars.OscarsStrategy(warmup_steps=1)
            folder = out / case.replace(":", "_")
            run_one(case, strategy, folder, slow=False, val_check_interval=0.5, limit_val_batches=2)
        elif case.startswith("ddp:"):  # what ddp does with the same case
            run_one(case.split(":", 1)[1], "ddp", out / case.replace(":", "_"))
        elif case == "batch_balance_buckets":  # balance="batch" cannot cut ddp's global batch from the user's
            run_one("buckets", oscars.OscarsStrategy(balance="batch", warmup_steps=1), out / case)
        else:
            run_one(case, oscars.OscarsStrategy(warmup_steps=1), out / case)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
