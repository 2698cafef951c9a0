"""Distributed checkpoints of sharded replicas: torch's ``torch.distributed.checkpoint`` (DCP) in Lightning's layout.

A checkpoint is a directory: DCP's shards and ``.metadata`` for the model (key ``"state_dict"``) and each optimizer
(``"optimizer_0"``, ...), and ``meta.pt`` beside them for the rest (loops, callbacks, the fit's round state), as
Lightning's ``ModelParallelStrategy`` writes it (so its loader and Lightning's ``consolidate_checkpoint`` read ours).

Each rank writes only its own shards; no rank ever holds the whole model. The replicas hold the same model after
the averaging that precedes a save, so only replica 0 writes (the other replicas take part in DCP's planning with
nothing to write): a parameter's shard is written once, and the optimizer state is replica 0's, as a full-state
checkpoint holds global rank 0's. Loading reads, on every rank, the parts its own tensors cover: into a sharded
module of any replica size, or whole into an unsharded module (DDP replicas, plain oscars). Nothing here knows about
Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "METADATA_FILE",
    "MODEL_KEY",
    "InDistributedCheckpoint",
    "is_distributed_checkpoint",
    "load_model",
    "load_optimizer",
    "optimizer_keys",
    "save_sharded",
    "sharded_model_state",
    "sharded_optimizer_state",
]

METADATA_FILE = "meta.pt"  # Lightning's name for the non-tensor part
MODEL_KEY = "state_dict"


class InDistributedCheckpoint:
    """Stands in a loaded checkpoint's dict for a part that stays in the checkpoint's shards until loaded into the
    model or optimizer (the checkpoint's ``"state_dict"`` / ``"optimizer_states"`` entries)."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key

    def __repr__(self) -> str:
        return f"InDistributedCheckpoint({str(self.path)!r}, {self.key!r})"


def is_distributed_checkpoint(path: Any) -> bool:
    """A directory holding DCP's ``.metadata`` and ``meta.pt``."""
    try:
        folder = Path(path)
    except TypeError:
        return False
    return folder.is_dir() and (folder / ".metadata").is_file() and (folder / METADATA_FILE).is_file()


def optimizer_keys(path: Path) -> list[str]:
    """The optimizers' keys a checkpoint holds, in order (``optimizer_0``, ``optimizer_1``, ...)."""
    from torch.distributed.checkpoint import FileSystemReader

    names = {fqn.split(".", 1)[0] for fqn in FileSystemReader(str(path)).read_metadata().state_dict_metadata}
    return [f"optimizer_{i}" for i in range(len(names)) if f"optimizer_{i}" in names]


def sharded_model_state(module: nn.Module) -> dict[str, Any]:
    """The module's state as it is held: each sharded parameter as this rank's shard (a ``DTensor``), buffers whole."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module)


def sharded_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, each state tensor of a sharded parameter as this rank's shard."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer)


def save_sharded(state: Mapping[str, Any], path: Path, writes: bool) -> None:
    """Write ``state`` (``"state_dict"``, ``"optimizer_i"``: this rank's shards) to the directory ``path``. Collective:
    every rank calls it; a rank with ``writes`` false plans with the others but writes nothing. Of the tensors several
    writing ranks hold whole (buffers, optimizer step counts), the lowest rank's is written."""
    import torch.distributed.checkpoint as dcp

    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    dcp.save(dict(state) if writes else {}, checkpoint_id=path, planner=planner)


def load_model(module: nn.Module, path: Path, strict: bool = True) -> None:
    """Load the checkpoint's model into ``module`` as it is held now (sharded or whole). Collective: every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = {MODEL_KEY: sharded_model_state(module)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state[MODEL_KEY], options=StateDictOptions(strict=strict))


def load_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, path: Path, key: str) -> None:
    """Load the checkpoint's optimizer ``key`` into ``optimizer`` (of ``module``'s parameters, sharded or whole): its
    state tensors and its parameter groups' hyperparameters. Collective: every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = {key: sharded_optimizer_state(module, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(module, optimizer, state[key])
