"""Lightning leaves a training loader that batches itself as the user wrote it, for one fit under oscars.

Under ddp Lightning re-makes every training ``DataLoader`` with a ``DistributedSampler`` (or its wrapper around the
user's sampler) so that each rank reads its shard. A loader that batches itself (a custom ``batch_sampler``, or
``batch_size=None`` over a sampler of index lists) does not survive that: a length-bucketing batch sampler cannot
take the injected sampler (Lightning raises), and a ``batch_size=None`` loader comes back batching single items.
oscars splits the epoch between ranks itself (``core/loader_shape.py``), so for such loaders the re-making is left
out while the fit runs; every other loader (validation, test, and training loaders with a ``batch_size``) is
prepared by Lightning as before, so that their order is ddp's.

The fit loop's request for the training loaders (the user's ``train_dataloader``) is also taken on every rank with
an agreement (``every_rank.py``): a hook that fails on one rank (a file missing on one node) is every rank's error at
once, instead of one rank raising while the others wait in the barrier Lightning holds after the request.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader

from lightning_oscars.core.loader_shape import loader_shape
from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.every_rank import on_every_rank
from lightning_oscars.lightning.patches import Patches

__all__ = ["UserBatching"]


class UserBatching:
    """The patches of one fit (:meth:`install` when it begins, :meth:`remove` when it ends)."""

    def __init__(self, strategy: ParallelStrategy) -> None:
        self._patches = Patches()
        self._strategy = strategy

    def install(self, trainer: Trainer) -> None:
        self.remove()
        owner, name = internals.dataloader_preparation(trainer)
        prepare = getattr(owner, name)

        def prepare_unless_self_batching(dataloader: object, shuffle: bool, mode: Any) -> object:
            if mode == RunningStage.TRAINING and isinstance(dataloader, DataLoader):
                if loader_shape(dataloader) != "samples":
                    return dataloader
            return prepare(dataloader, shuffle=shuffle, mode=mode)

        self._patches.replace(owner, name, prepare_unless_self_batching)
        source, request_name = internals.training_loader_request(trainer)
        request = getattr(source, request_name)
        strategy = self._strategy

        def request_on_every_rank() -> Any:
            return on_every_rank(strategy, "requesting its training loaders (train_dataloader)", request)

        self._patches.replace(source, request_name, request_on_every_rank)

    def remove(self) -> None:
        self._patches.undo()
