"""Samplers in the shapes libraries give them, shared by the in-process and the multi-process loader-shape tests."""

from __future__ import annotations

import torch
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler


class LengthBuckets(Sampler):
    """Length-bucketed batches (speech and NLP code): samples of one bucket (``i % 3``) together, the batches' order
    shuffled per epoch by ``seed``."""

    def __init__(self, n: int, batch_size: int, seed: int = 0) -> None:
        self.n, self.batch_size, self.seed, self.epoch = n, batch_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        size = self.batch_size
        buckets = [[i for i in range(self.n) if i % 3 == b] for b in range(3)]
        batches = [bucket[j : j + size] for bucket in buckets for j in range(0, len(bucket), size)]
        order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return [batches[k] for k in order.tolist()]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


class BatchesOfShard(DistributedSampler):
    """A library's own ddp sampler (single-cell tools): this rank's shard of a shuffled order, in batches, used with
    ``batch_size=None``."""

    def __init__(self, dataset, batch_size: int, **kwargs) -> None:
        super().__init__(dataset, **kwargs)
        self.batch_size = batch_size

    def __iter__(self):
        indices = list(super().__iter__())
        return iter([indices[i : i + self.batch_size] for i in range(0, len(indices), self.batch_size)])

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)
