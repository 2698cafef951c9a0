"""Every reach into torch.distributed's private state, and the process-group lifecycle, in one small module.

The rest of the package uses torch.distributed's public API only. What it needs beyond that is the default group's
rendezvous store (shared counters and failure notes ride in it, so that no collective is spent on them), reached
through ``distributed_c10d._get_default_store``; a torch upgrade that moves it breaks this file alone.
"""

from __future__ import annotations

import atexit
from typing import Any

import torch

from lightning_oscars.core.replicas import ReplicaLayout

__all__ = [
    "default_store",
    "default_store_or_none",
    "destroy_gloo_group_at_exit",
    "destroy_group",
    "new_gloo_group",
    "replica_groups",
    "retire_group",
]

# Groups a fit made and no longer uses on this rank, destroyed when the next group is made (see new_gloo_group).
_RETIRED: list[Any] = []


def default_store() -> Any:
    """The rendezvous store of torch.distributed's default group (raises without one)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def default_store_or_none() -> Any | None:
    """:func:`default_store`, or ``None`` without a default group (one process) or a backend without a store."""
    try:
        return default_store()
    except Exception:  # noqa: BLE001 - no group, or a backend without a store: callers fall back
        return None


def destroy_group(group: Any) -> None:
    """Destroy a process group a fit created (``new_group``), if the default group still exists.

    Local for gloo (no collective): it cannot hang on a peer that already left. Call it only once nothing of this
    rank still waits on the group (a server thread joined, no exchange pending), or a blocked receive would abort.
    """
    dist = torch.distributed
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError, KeyError):  # already destroyed with the default group
        pass


def retire_group(group: Any) -> None:
    """This rank no longer uses ``group`` (its fit ended cleanly): destroy it at the next :func:`new_gloo_group`.

    Not at once: a peer may still be using its end of the group (a server thread answering a last request), and
    closing this rank's connections under it would fail its receive.
    """
    if group is not None:
        _RETIRED.append(group)


def new_gloo_group() -> Any:
    """A gloo process group over every rank (collective), after which the retired groups are destroyed: every rank
    takes part in making the new group, so every rank has ended the fit that retired the old ones."""
    group = torch.distributed.new_group(backend="gloo")
    while _RETIRED:
        destroy_group(_RETIRED.pop())
    return group


def replica_groups(
    replica_size: int | str, spans_nodes: bool, world_size: int, rank: int, node_rank: int, timeout: Any = None
) -> tuple[ReplicaLayout, Any]:
    """The run's replica layout and this rank's replica group (``None`` with one rank per replica). Collective when
    ``replica_size`` is not 1: every rank learns every rank's node, so that a bad layout fails on every rank alike
    before any group exists, then every rank makes every replica's group (on the default backend); the retired
    groups are destroyed after."""
    if replica_size == 1 or world_size == 1:
        return ReplicaLayout(world_size), None
    nodes: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(nodes, node_rank)
    layout = ReplicaLayout.resolve(replica_size, world_size, nodes, spans_nodes)
    mine = None
    for replica in range(layout.replicas):
        group = torch.distributed.new_group(layout.ranks_of(replica), timeout=timeout)  # the strategy's timeout
        if replica == layout.replica_of(rank):
            mine = group
    while _RETIRED:
        destroy_group(_RETIRED.pop())
    return layout, mine


_EXIT_HANDLER_REGISTERED = False


def destroy_gloo_group_at_exit() -> None:
    """Destroy a gloo default process group when the interpreter exits, while it is still fully alive.

    Left to interpreter finalisation, gloo's worker threads can still hold finished work whose tensors need the
    GIL, and the process aborts ("terminate called without an active exception", exit code 134) after training
    succeeded; seen under ddp and oscars alike in about one run in three. Destroying is local for gloo (no
    collective), so it cannot hang on a peer that already left. NCCL groups are left to the user and Lightning.
    """
    global _EXIT_HANDLER_REGISTERED
    if _EXIT_HANDLER_REGISTERED:
        return
    _EXIT_HANDLER_REGISTERED = True

    def destroy() -> None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()

    atexit.register(destroy)
