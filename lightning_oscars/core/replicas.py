"""Replica groups: which ranks train as one replica, and how a replica's batch is split among them.

With ``replica_size=k`` the ``W`` ranks form ``W / k`` replicas of ``k`` consecutive ranks (by default: one rank,
one replica). Inside a replica the ranks are plain data parallel (torch's ``DistributedDataParallel`` on the
replica's process group), so they hold the same model after every step; across replicas, oscars' rounds run as if
each replica were one rank: it gets local steps, a share of the epoch and one model in the round's average.

A replica's batch is ``k`` of the user's batches: ``k * batch_size`` consecutive samples of the epoch's order, which
its ranks split evenly (:meth:`ReplicaLayout.member_span`). Pure arithmetic: no Lightning, no torch.distributed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

__all__ = ["Place", "ReplicaLayout", "replica_batch_sizes", "replica_batches"]


class Place(TypedDict):
    """A rank's place as :class:`~lightning_oscars.core.rounds.RoundController` takes it: the replicas are its ranks."""

    world_size: int
    rank: int
    member: int
    replica_size: int


@dataclass(frozen=True)
class ReplicaLayout:
    """``world_size`` ranks in replicas of ``replica_size`` consecutive ranks."""

    world_size: int
    replica_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.replica_size < 1:
            raise ValueError(f"a layout of {self.replica_size} ranks per replica in a world of {self.world_size}")
        if self.world_size % self.replica_size:
            raise ValueError(
                f"replica_size={self.replica_size} does not divide the {self.world_size} ranks into equal replicas"
                f" (choose a divisor of {self.world_size})"
            )

    @property
    def replicas(self) -> int:
        return self.world_size // self.replica_size

    def replica_of(self, rank: int) -> int:
        return rank // self.replica_size

    def member_of(self, rank: int) -> int:
        """The rank's place inside its replica (0: the replica's first rank, which reports its measurements)."""
        return rank % self.replica_size

    def ranks_of(self, replica: int) -> list[int]:
        return list(range(replica * self.replica_size, (replica + 1) * self.replica_size))

    def place(self, rank: int) -> Place:
        """Where ``rank`` sits, as the round controller takes it."""
        return {
            "world_size": self.replicas,
            "rank": self.replica_of(rank),
            "member": self.member_of(rank),
            "replica_size": self.replica_size,
        }

    def member_span(self, start: int, end: int, member: int) -> tuple[int, int]:
        """Member ``member``'s part of the positions ``[start, end)`` of a replica's batch: ``k`` contiguous parts
        whose sizes differ by at most one (all equal for a full batch)."""
        n, k = end - start, self.replica_size
        return start + (member * n) // k, start + ((member + 1) * n) // k

    @classmethod
    def resolve(
        cls, replica_size: int | str, world_size: int, node_of: Sequence[int], spans_nodes: bool = False
    ) -> ReplicaLayout:
        """The layout an option asks for: ``1``, ``k`` consecutive ranks, or ``"node"`` (the ranks of a node).
        ``node_of[r]``: rank ``r``'s node. A replica must lie on one node unless ``spans_nodes``: its every step
        all-reduces gradients, which across nodes costs what local SGD saves."""
        if len(node_of) != world_size:
            raise ValueError(f"{len(node_of)} node ids for a world of {world_size} ranks")
        if replica_size == "node":
            sizes = {node: node_of.count(node) for node in dict.fromkeys(node_of)}
            if len(set(sizes.values())) > 1:
                raise ValueError(
                    "replica_size='node' needs the same number of ranks on every node; ranks per node: "
                    + ", ".join(f"node {n}: {c}" for n, c in sizes.items())
                    + ". Give replica_size a number that divides every node's ranks."
                )
            layout = cls(world_size, next(iter(sizes.values())))
            if any(len({node_of[r] for r in layout.ranks_of(i)}) > 1 for i in range(layout.replicas)):
                raise ValueError(
                    "replica_size='node' needs each node's ranks to be consecutive global ranks; nodes of ranks: "
                    + str(list(node_of))
                )
            return layout
        if isinstance(replica_size, bool) or not isinstance(replica_size, int) or replica_size < 1:
            raise ValueError(f"replica_size must be a positive integer or 'node', got {replica_size!r}")
        if world_size % replica_size:
            raise ValueError(
                f"replica_size={replica_size} does not divide the world of {world_size} ranks into equal replicas"
            )
        layout = cls(world_size, replica_size)
        if not spans_nodes:
            for replica in range(layout.replicas):
                nodes = sorted({node_of[r] for r in layout.ranks_of(replica)})
                if len(nodes) > 1:
                    raise ValueError(
                        f"replica_size={replica_size} puts ranks {layout.ranks_of(replica)} of nodes {nodes} in one"
                        " replica, whose gradients would cross the network at every step. Use a replica_size that"
                        " divides the ranks per node (or 'node'), or pass replica_spans_nodes=True if you mean it."
                    )
        return layout


def replica_batch_sizes(sizes: Sequence[int], layout: ReplicaLayout) -> list[int]:
    """Each replica's batch size per rank from every rank's (``batch_sizes=``): the ranks of a replica step together
    on one batch split evenly among them, so they must have the same size."""
    if len(sizes) != layout.world_size:
        raise ValueError(f"{len(sizes)} batch sizes for a world of {layout.world_size} ranks")
    per_replica = []
    for replica in range(layout.replicas):
        ranks = layout.ranks_of(replica)
        mine = {sizes[r] for r in ranks}
        if len(mine) > 1:
            raise ValueError(
                f"batch_sizes gives the ranks {ranks} of one replica the sizes {[sizes[r] for r in ranks]}: a replica's"
                " ranks step together on one batch split evenly among them, so give them the same size"
            )
        per_replica.append(sizes[ranks[0]])
    return per_replica


def replica_batches(num_samples: int, batch_size: int, replica_size: int, drop_last: bool) -> int:
    """How many replica batches (``replica_size * batch_size`` samples each) an epoch of ``num_samples`` holds.
    Without ``drop_last`` the last one keeps the remainder; a remainder too small to give each of the replica's ranks
    a sample joins the batch before it instead, so that no rank of a replica ever has nothing to step on."""
    size = replica_size * batch_size
    if drop_last:
        return num_samples // size
    batches = math.ceil(num_samples / size)
    remainder = num_samples - (batches - 1) * size
    if batches > 1 and remainder < replica_size:
        batches -= 1
    return batches
