"""The smallest extra scheme, written outside the package as a user would write one: gossip averaging with one
fixed partner. It is the example of ``docs/adding-a-scheme.md``: a scheme (combine the models; the fit session
owns the round's control data, and sums it itself since this scheme carries none), a strategy that makes it, and
its registration.
Nothing of the package is edited; ``tests/test_multiprocess.py::test_a_scheme_written_outside_the_package_trains``
fits a model with it by name on 2 ranks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry
from torch import Tensor

from lightning_oscars import OscarsStrategy, RoundMeeting, SyncScheme


class PairGossip(SyncScheme):
    """At every meeting, ranks 2k and 2k+1 average their models (an odd last rank keeps its own)."""

    name = "pair_gossip"

    def __init__(self) -> None:
        self.pair: object = None
        self.meetings = 0

    def bind(self, parameters: Iterable[Tensor]) -> None:
        n, rank = dist.get_world_size(), dist.get_rank()
        self.pair, self.meetings = None, 0
        for first in range(0, n - 1, 2):
            group = dist.new_group([first, first + 1])  # every rank makes every pair's group, in one order
            if rank in (first, first + 1):
                self.pair = group

    def combine(self, tensors: Sequence[Tensor], meeting: RoundMeeting) -> None:
        self.meetings += 1
        if self.pair is None:
            return
        with torch.no_grad():
            for tensor in tensors:
                if tensor.dtype == torch.bool:
                    continue
                dist.all_reduce(tensor, group=self.pair)
                if tensor.is_floating_point():
                    tensor.div_(2)
                else:
                    tensor.floor_divide_(2)


class PairGossipStrategy(OscarsStrategy):
    """Oscars' balanced rounds, each ending in a pair's average instead of the global one."""

    strategy_name = "pair_gossip"
    description = "Test fixture: oscars' rounds, every rank averaging with one fixed partner"

    def make_scheme(self) -> SyncScheme:
        return PairGossip()


PairGossipStrategy.register_strategies(StrategyRegistry)
