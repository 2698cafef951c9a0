"""The strategy's hooks for ``shard_replicas=True``: FSDP2 inside each replica, as Lightning's
``ModelParallelStrategy`` users write it, and oscars' rounds across the replicas (``dist/sharding.py``).

A mixin of ``OscarsStrategy`` (``strategy.py``), inert unless ``shard_replicas`` is on:

* :meth:`_make_replica_mesh` (after the replica layout is known, every rank): the device mesh, and the module's
  ``self.device_mesh``: the replica's mesh, dims ``"data_parallel"`` (the replica's ranks) and ``"tensor_parallel"``
  (size 1), for ``configure_model`` to call ``fully_shard(..., mesh=self.device_mesh["data_parallel"])``;
* :meth:`_configure_sharded` (in place of the replica's DDP wrapper): a module that sharded nothing is sharded by
  default (each top-level child holding parameters), every parameter must then be sharded, and every replica starts
  from replica 0's shards;
* checkpoints: by default (``save_distributed_checkpoint``) a directory of each rank's shards, written by replica 0
  with torch's distributed checkpoint (``dist/sharded_checkpoint.py``); on request, or when a survivor of a lost rank
  saves for a restart, the full state (gathered inside each replica, written by rank 0). Both load into a sharded
  module and into an unsharded one, of any layout: the strategy loads a distributed checkpoint under any options.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_oscars.core.replicas import ReplicaLayout
from lightning_oscars.dist.sharded_checkpoint import (
    METADATA_FILE,
    MODEL_KEY,
    InDistributedCheckpoint,
    is_distributed_checkpoint,
    load_model,
    load_optimizer,
    optimizer_keys,
    save_sharded,
    sharded_model_state,
    sharded_optimizer_state,
)
from lightning_oscars.dist.sharding import (
    check_shardable,
    fsdp_keywords,
    keyed_by_name,
    keyed_by_position,
    parameter_names,
    replica_mesh,
    shard_by_default,
    sharded_parameters,
    sync_sharded_states,
)
from lightning_oscars.lightning import _internals as internals

__all__ = ["ShardedReplicaHooks"]


def to_cpu(state: Any) -> Any:
    return apply_to_collection(state, torch.Tensor, lambda t: t.cpu())


class ShardedReplicaHooks(DDPStrategy):
    """See the module docstring. The subclass calls :meth:`_make_replica_mesh` and :meth:`_configure_sharded`."""

    _mesh: DeviceMesh | None = None
    _exclude_checkpoint_time: Callable[[float], None]  # LocalStepCollectives': a checkpoint's write is not training
    _everywhere = False  # gather the full state on every rank, not only global rank 0 (a recovery point's save)

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The run's mesh under ``shard_replicas`` (dims ``"replicate"``, ``"data_parallel"``,
        ``"tensor_parallel"``); ``None`` otherwise."""
        return self._mesh

    @property
    def shard_group(self) -> Any:
        """The ranks holding this rank's shard in every replica (``None`` without sharded replicas)."""
        return None if self._mesh is None else self._mesh["replicate"].get_group()

    @property
    def _options(self) -> Any:
        return self  # the subclass's OscarsOptions (shard_replicas, shard_options, save_distributed_checkpoint)

    def _make_replica_mesh(self, layout: ReplicaLayout) -> None:
        options = self._options
        self._mesh = None
        if not options.shard_replicas or self.world_size == 1:
            return
        if layout.replica_size == 1:
            raise ValueError(
                f"shard_replicas=True needs replicas of 2 ranks or more; replica_size={options.replica_size!r} gives"
                f" one rank per replica on this world of {self.world_size}"
            )
        self._mesh = replica_mesh(layout, self.root_device.type)
        module = self.lightning_module
        if module is not None:
            internals.set_device_mesh(module, self._mesh["data_parallel", "tensor_parallel"])

    def _configure_sharded(self, sync: bool = True) -> None:
        """In place of the replica's DDP wrapper (``configure_ddp``): shard, check, and start from replica 0 (unless
        not ``sync``: a restart's survivors, merged at the first collective)."""
        assert self.model is not None and self._mesh is not None
        check_shardable(self.model)
        shard_options = self._options.shard_options
        if not sharded_parameters(self.model):
            mesh = self._mesh["data_parallel"]
            children = shard_by_default(self.model, mesh, **fsdp_keywords(shard_options))
            rank_zero_info(f"oscars: shard_replicas: sharded {children} with FSDP2 inside each replica")
        elif shard_options:
            rank_zero_warn(
                "shard_options configure the strategy's default sharding; configure_model sharded the module itself,"
                " so they were not applied (pass them to fully_shard there)"
            )
        unsharded = [name for name, p in self.model.named_parameters() if not isinstance(p, DTensor)]
        if unsharded:
            raise ValueError(
                f"shard_replicas=True: the parameters {unsharded} are not sharded (configure_model sharded other"
                " parts only). Shard every submodule that holds parameters, or none and let the strategy do it."
            )
        if sync:
            sync_sharded_states(self.model, self._mesh)

    # ------------------------------------------------------------------ checkpoints

    def _sharded(self) -> bool:
        return self.model is not None and bool(sharded_parameters(self.model))

    def _saves_distributed(self) -> bool:
        """Checkpoints are written as each rank's shards (not while survivors of a lost rank save for a restart:
        the distributed checkpoint's planning is a collective over every rank)."""
        return self._options.save_distributed_checkpoint and self._sharded() and not self._everywhere

    @contextmanager
    def full_state_on_every_rank(self) -> Iterator[None]:
        """Within: the model and optimizer state are gathered whole on every rank (each replica's survivors save
        their replica's state for a restart), not only on global rank 0."""
        self._everywhere = True
        try:
            yield
        finally:
            self._everywhere = False

    def _full_options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=not self._everywhere)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._sharded():
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        self._options.average_if_pending()  # checkpoints hold the averaged model (collective: every rank)
        if self._saves_distributed():
            return sharded_model_state(self.model)
        return to_cpu(get_model_state_dict(self.model, options=self._full_options()))  # gathered in each replica

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._sharded():
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.model is not None
        if self._saves_distributed():
            return sharded_optimizer_state(self.model, optimizer)
        state = to_cpu(get_optimizer_state_dict(self.model, optimizer, options=self._full_options()))
        if not state:  # gathered to global rank 0 only, which writes the checkpoint
            return {}
        return keyed_by_position(state, parameter_names(self.model, optimizer))  # as an unsharded optimizer keys it

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not self._saves_distributed():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        # Every rank writes its shards into one directory: rank 0's path, made a directory before anyone writes.
        path = Path(self.broadcast(str(filepath)))
        if self.is_global_zero:
            if path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        self.barrier("oscars: distributed checkpoint")
        shards = {MODEL_KEY: checkpoint.pop(MODEL_KEY)}
        shards.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        writes = self._mesh is not None and self._mesh.get_coordinate()[0] == 0  # type: ignore[index]
        save_sharded(shards, path, writes=writes)  # replica 0 writes: the replicas hold the same model
        self._exclude_checkpoint_time(time.perf_counter() - started)
        super().save_checkpoint(checkpoint, path / METADATA_FILE, storage_options)  # the rest, by rank 0

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if not is_distributed_checkpoint(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # The model and optimizers stay in the shards until Lightning hands them to load_*_state_dict below.
        path = Path(checkpoint_path)
        checkpoint = super().load_checkpoint(path / METADATA_FILE, weights_only=weights_only)
        checkpoint[MODEL_KEY] = InDistributedCheckpoint(path, MODEL_KEY)
        keys = optimizer_keys(path)
        if keys:
            checkpoint["optimizer_states"] = [InDistributedCheckpoint(path, key) for key in keys]
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        source = checkpoint.get(MODEL_KEY)
        if isinstance(source, InDistributedCheckpoint):  # into the module as it is held: sharded or whole
            assert self.lightning_module is not None
            return load_model(self.lightning_module, source.path, strict=strict)
        if not self._sharded():  # sharded later (by default, in configure_ddp): a plain load now
            return super().load_model_state_dict(checkpoint, strict=strict)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        assert self.model is not None
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(self.model, checkpoint[MODEL_KEY], options=options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if any(isinstance(s, InDistributedCheckpoint) for s in states):
            if len(states) != len(self.optimizers):
                raise ValueError(
                    f"the checkpoint {states[0].path} holds {len(states)} optimizers; configure_optimizers returned"
                    f" {len(self.optimizers)}"
                )
            assert self.lightning_module is not None
            for optimizer, source in zip(self.optimizers, states):
                load_optimizer(self.lightning_module, optimizer, source.path, source.key)
            return
        if not self._sharded():
            return super().load_optimizer_state_dict(checkpoint)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        assert self.model is not None
        for optimizer, state in zip(self.optimizers, states):
            by_name = keyed_by_name(state, parameter_names(self.model, optimizer))
            set_optimizer_state_dict(self.model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
