"""Sharded replicas on 4 ranks as 2 replicas of 2 (ranks 2-3 3x slower), several fits in the same four processes (one
launch): FSDP2 inside each replica against DDP replicas on a pinned schedule, the model shapes users have, the module
sharding itself in ``configure_model``, checkpoints and resume across layouts. Each rank writes what it trained and
ended with as JSON.

Usage: python tests/sharded_case.py OUT_DIR. Launched by tests/test_sharded_replicas.py (with a timeout)."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from paradigm_models_case import CLASSES, FEATURES  # noqa: E402
from replicas_case import SLOWER, IndexedModule, StopOnRank, digest, outcome, resume_between, trainer  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

PINNED = {"replica_size": 2, "local_steps": [3, 1]}  # the schedule fixed: the same rounds under both
SHARDED = {"replica_size": 2, "shard_replicas": True}
MIXED = {"mp_policy": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}, "reshard_after_forward": False}
# name -> (model, strategy options, Trainer options)
FITS: dict[str, tuple[str, dict, dict]] = {
    "ddp_pinned": ("mlp", PINNED, {"max_epochs": 2, "limit_val_batches": 1.0}),
    "sharded_pinned": ("mlp", {**PINNED, **SHARDED}, {"max_epochs": 2, "limit_val_batches": 1.0}),
    "sharded_batchnorm": ("batchnorm", SHARDED, {"max_epochs": 1, "accumulate_grad_batches": 2}),
    "sharded_frozen": ("frozen", {**SHARDED, "solver": "uniform", "max_local_steps": 3}, {"max_epochs": 1}),
    "sharded_transformer": ("transformer", SHARDED, {"max_epochs": 1}),
    "sharded_configure_model": ("self_sharded", SHARDED, {"max_epochs": 1}),
    "sharded_bf16": ("mlp", SHARDED, {"max_epochs": 1, "precision": "bf16-mixed"}),
    # a batch size per replica (replica 0 on 12 per rank, replica 1 on 4), as with DDP replicas
    "sharded_replica_sizes": ("mlp", {**SHARDED, "batch_sizes": [12, 12, 4, 4]}, {"max_epochs": 1}),
    # FSDP2's own mixed precision for the default sharding: bf16 compute, the shards (and their averaging) in fp32
    "sharded_fsdp_mixed_precision": ("mlp", {**SHARDED, "shard_options": MIXED}, {"max_epochs": 1}),
    # the last layer takes gradients (reduce-scattered) but no optimizer steps it
    "sharded_unowned": ("unowned", SHARDED, {"max_epochs": 1}),
    # both replicas at one speed (every other sharded fit has the second 3x slower)
    "sharded_equal_speeds": ("mlp", SHARDED, {"max_epochs": 2}),
    # forwards without a backward: a validation every half epoch, and a callback's no-grad forward after every step
    # on the second replica
    "sharded_peeking": ("mlp", SHARDED, {"max_epochs": 2, "limit_val_batches": 1.0, "val_check_interval": 0.5}),
}
PEEKING = {"sharded_peeking"}
EQUAL_SPEEDS = {"sharded_equal_speeds"}


class TinyTransformer(nn.Module):
    """A transformer block over one token per sample: attention, layer norms and a feed-forward to shard."""

    def __init__(self, features: int = FEATURES, classes: int = CLASSES, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.block = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.embed(x).unsqueeze(1)).squeeze(1))


class ShardedModule(IndexedModule):
    """Records how many parameter elements this rank holds while training, against the model's whole count."""

    def __init__(self, model: str) -> None:
        super().__init__("mlp" if model in ("transformer", "self_sharded", "unowned") else model)
        self.unowned = model == "unowned"
        if model == "transformer":
            self.net = TinyTransformer()
        self.self_sharded = model == "self_sharded"
        self.whole = sum(p.numel() for p in self.net.parameters())
        self.held: int | None = None
        self.gathered_steps = 0  # training steps that began with a parameter whole (not this rank's shard)
        self.computed_in = ""  # the dtype of the network's output in training
        self.net.register_forward_hook(self._record_dtype)

    def _record_dtype(self, net: nn.Module, inputs: object, output: Tensor) -> None:
        if self.training:
            self.computed_in = str(output.dtype)

    def configure_model(self) -> None:
        if self.self_sharded:  # as ModelParallelStrategy's users write it: each layer, then the container
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def untrained(self) -> list[Tensor]:
        """The parameters no step may change: frozen ones, and (``"unowned"``) those no optimizer owns."""
        unowned = {id(p) for p in self.net[2].parameters()} if self.unowned else set()
        return [p for p in self.parameters() if not p.requires_grad or id(p) in unowned]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if not self.unowned:
            return super().configure_optimizers()
        return torch.optim.SGD(self.net[0].parameters(), lr=0.05, momentum=0.9)

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.held is None:
            self.held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in self.parameters())
        if not all(isinstance(p, DTensor) for p in self.parameters()):
            self.gathered_steps += 1
        return super().training_step(batch, batch_idx)


class PeekAfterStep(L.Callback):
    """A callback that looks at the network's predictions after every step on the second replica's ranks, as a
    monitoring callback on some ranks does: a forward without a backward, which leaves FSDP2's root module gathered
    there while the first replica's ranks hold their shards."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        if trainer.global_rank >= 2:
            with torch.no_grad():
                pl_module.net(torch.zeros(2, FEATURES))


def sharded_outcome(module: ShardedModule, fitted: L.Trainer) -> dict:
    result = outcome(module, fitted)
    mesh = fitted.strategy.device_mesh
    return {
        **result,
        "wrapped": type(module.net).__name__,
        "sharded": all(isinstance(p, DTensor) for p in module.parameters()),
        "held": module.held,
        "gathered_steps": module.gathered_steps,
        "whole": module.whole,
        "computed_in": module.computed_in,
        "stored_in": sorted({str(p.dtype) for p in module.parameters()}),
        "mesh": None if mesh is None else list(mesh.mesh_dim_names),
        "shard_group": id(fitted.strategy.shard_group),
        "parameters": digest(module.net, buffers=False),
        "vector": torch.cat([full(p).detach().float().reshape(-1) for p in module.net.parameters()]).tolist(),
    }


def full(tensor: Tensor) -> Tensor:
    """A parameter whole (a sharded one gathered inside its replica: every rank of it calls this alike)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def fit_one(name: str) -> dict:
    model, options, trainer_options = FITS[name]
    L.seed_everything(0, verbose=False)
    module = ShardedModule(model)
    frozen_before = [p.detach().clone() for p in module.untrained()]
    callbacks = [PeekAfterStep()] if name in PEEKING else []
    fitted = trainer(options, trainer_options, callbacks, slower={} if name in EQUAL_SPEEDS else SLOWER)
    fitted.fit(module)
    result = sharded_outcome(module, fitted)
    frozen_after = [full(p) for p in module.untrained()]
    result["frozen_kept"] = all(torch.equal(a, b.detach()) for a, b in zip(frozen_before, frozen_after))
    return result


def stop_from_one_rank() -> dict:
    """The second replica's second rank asks to stop after its second step: every rank stops at one round boundary."""
    L.seed_everything(0, verbose=False)
    module = ShardedModule("mlp")
    fitted = trainer(SHARDED, {"max_epochs": 2}, [StopOnRank(3, after=2)])
    fitted.fit(module)
    return {**sharded_outcome(module, fitted), "epoch": fitted.current_epoch}


class SavedModels(L.Callback):
    """At every checkpoint save, the model each rank holds then (whole: gathered inside its replica)."""

    def __init__(self) -> None:
        self.saves: list[dict] = []

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        mid_epoch = trainer.fit_loop.epoch_loop.batch_progress.current.ready < trainer.num_training_batches
        self.saves.append({"step": trainer.global_step, "mid_epoch": mid_epoch, "model": digest(pl_module.net)})


def checkpoints_mid_round(out: Path) -> dict:
    """A checkpoint every 3 steps (mid-round: the rounds are longer): each holds the averaged model, one on every
    rank, whether distributed or full-state."""
    result = {}
    for distributed in (True, False):
        L.seed_everything(0, verbose=False)
        saves = SavedModels()
        folder = out / f"every_3_{distributed}"
        every = L.pytorch.callbacks.ModelCheckpoint(folder, every_n_train_steps=3, save_top_k=-1)
        options = {**SHARDED, "save_distributed_checkpoint": distributed, "local_steps": [4, 2]}
        fitted = trainer(options, {"max_epochs": 2}, [every, saves])
        fitted.fit(ShardedModule("batchnorm"))
        result[str(distributed)] = saves.saves
    return result


def resume(out: Path, first: dict, then: dict) -> dict:
    """One epoch under ``first`` saving ``last.ckpt``, then a second resumed from it under ``then``."""
    checkpoints = out / ("resume_" + "_".join(str(v) for v in (*first.values(), "then", *then.values())))
    return resume_between(checkpoints, first, then, ShardedModule, sharded_outcome)


# name -> (strategy options saving, strategy options loading, the saving module's model, the loading module's)
ROUND_TRIPS: dict[str, tuple[dict, dict, str, str]] = {
    "distributed_into_sharded": (SHARDED, SHARDED, "batchnorm", "batchnorm"),
    "distributed_into_self_sharded": (SHARDED, SHARDED, "mlp", "self_sharded"),
    "distributed_into_ddp_replicas": (SHARDED, {"replica_size": 2}, "batchnorm", "batchnorm"),
    "distributed_into_plain": (SHARDED, {"replica_size": 1}, "batchnorm", "batchnorm"),
    "full_into_sharded": ({**SHARDED, "save_distributed_checkpoint": False}, SHARDED, "batchnorm", "batchnorm"),
    # Lightning's own ModelParallelStrategy (4-way sharding) loads it, the module sharding itself
    "distributed_into_model_parallel": (SHARDED, {"model_parallel": True}, "mlp", "self_sharded"),
    # and the other way: a checkpoint ModelParallelStrategy wrote (one model sharded 4 ways) into sharded replicas
    "model_parallel_into_sharded": ({"model_parallel": True}, SHARDED, "self_sharded", "mlp"),
}


def round_trip_trainer(options: dict, callbacks: list | None = None) -> L.Trainer:
    """One epoch under oscars' ``options``, or under Lightning's ModelParallelStrategy sharding 4 ways."""
    if not options.get("model_parallel"):
        return trainer(options, {"max_epochs": 1}, callbacks)
    strategy = L.pytorch.strategies.ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)
    quiet = {"enable_progress_bar": False, "enable_model_summary": False, "enable_checkpointing": bool(callbacks)}
    return L.Trainer(
        strategy=strategy, accelerator="cpu", devices=4, max_epochs=1, logger=False, callbacks=callbacks, **quiet
    )


def held_state(module: ShardedModule, optimizer: torch.optim.Optimizer) -> dict:
    """The module's parameters and buffers and the optimizer's momentum, whole (gathered inside the replica)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    whole = StateDictOptions(full_state_dict=True, cpu_offload=False)
    moments = get_optimizer_state_dict(module, optimizer, options=whole)["state"]
    return {
        "model": {name: full(t).detach().float().reshape(-1).tolist() for name, t in module.net.state_dict().items()},
        "momentum": {name: s["momentum_buffer"].reshape(-1).tolist() for name, s in sorted(moments.items())},
    }


def round_trip(out: Path, name: str) -> dict:
    """One epoch under the saving options, checkpointed at its end; then a fit under the loading options from a
    differently seeded module that only loads the checkpoint (its one epoch is done): what it holds after loading."""
    saving, loading, saved_model, model = ROUND_TRIPS[name]
    folder = out / f"round_trip_{name}"
    L.seed_everything(0, verbose=False)
    module = ShardedModule(saved_model)
    fitted = round_trip_trainer(saving, [L.pytorch.callbacks.ModelCheckpoint(folder, save_last=True)])
    fitted.fit(module)
    saved = held_state(module, fitted.strategy.optimizers[0])
    L.seed_everything(1, verbose=False)
    module = ShardedModule(model)
    fitted = round_trip_trainer(loading)
    fitted.fit(module, ckpt_path=str(folder / "last.ckpt"))
    checkpoint = folder / "last.ckpt"
    files = {p.name: p.stat().st_size for p in checkpoint.iterdir()} if checkpoint.is_dir() else None
    return {
        "saved": saved,
        "loaded": held_state(module, fitted.strategy.optimizers[0]),
        "sharded": all(isinstance(p, DTensor) for p in module.parameters()),
        "global_step": fitted.global_step,
        "files": files,
        "checkpoint": str(checkpoint),
    }


def main() -> None:
    out = Path(sys.argv[1])
    dump_after = float(os.environ.get("OSCARS_TEST_DUMP_AFTER", "0"))
    if dump_after > 0:  # a hang prints every rank's stack (to the test's log) and exits instead of waiting
        faulthandler.dump_traceback_later(dump_after, exit=True)
    results: dict[str, dict] = {name: fit_one(name) for name in FITS}
    results["sharded_stop"] = stop_from_one_rank()
    results["resume_sharded"] = resume(out, SHARDED, SHARDED)
    results["resume_sharded_into_ddp"] = resume(out, SHARDED, {"replica_size": 2})
    results["resume_ddp_into_sharded"] = resume(out, {"replica_size": 1}, SHARDED)
    results.update({f"round_trip_{name}": round_trip(out, name) for name in ROUND_TRIPS})
    results["checkpoints_mid_round"] = checkpoints_mid_round(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{results['ddp_pinned']['rank']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
