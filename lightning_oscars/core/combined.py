"""Several training loaders in one step (Lightning's ``CombinedLoader``: a dict or list of them), split as one.

Every rank steps on a batch of each loader at once, so the loaders share one plan: the *lead* (the loader whose
batches the mode counts, ``lead_index``) is planned and decides every slot, and each other loader (a *follower*)
fetches, for the lead's plan batch ``b``, its own batch ``follow(b)``:

* ``"max_size_cycle"`` (Lightning's default for training): the longest loader leads; a shorter one cycles
  (``b mod`` its batches), as ddp's combined loader restarts it;
* ``"max_size"``: the longest leads; a shorter one has no batch past its end (``None``, as under ddp);
* ``"min_size"``: the shortest leads; the others' batches past its end are not trained (as under ddp).

Each loader keeps its own order (sampler, shuffle, seed), batch size and collate function, so within an epoch the
lead's batches are trained once each, and every loader's as its mode says. ``"sequential"`` (one loader after the
other) is refused, as Lightning's fit loop refuses it under every strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_oscars.core.quotas import block_widths

__all__ = ["COMBINED_MODES", "empty_batch", "follower_map", "lead_index", "plan_batches"]

COMBINED_MODES = ("max_size_cycle", "max_size", "min_size")


def empty_batch(batch: Any) -> Any:
    """``batch`` with every tensor of at least one dimension cut to zero rows (a no-op slot's batch)."""
    return apply_to_collection(batch, Tensor, lambda t: t[:0] if t.dim() > 0 else t)


def plan_batches(
    batch_size: int, batch_sizes: Sequence[int] | None, world_size: int, replica_size: int
) -> tuple[int, tuple[int, ...] | None]:
    """The samples per rank of one of the plan's batches, and each replica's batch in them (``None``: one)."""
    if batch_sizes is None:
        return batch_size, None
    if len(batch_sizes) != world_size:
        raise ValueError(f"batch sizes {list(batch_sizes)} for {world_size} replicas of {replica_size} ranks")
    block, widths = block_widths(batch_sizes)
    return block, widths if any(w != 1 for w in widths) else None


def check_mode(mode: str, loaders: int) -> None:
    if mode == "sequential":  # Lightning's own fit loop refuses it under every strategy (ddp too), at the epoch's run
        raise ValueError(
            f"{loaders} training loaders are combined in mode 'sequential', which Lightning's fit loop does not train"
            " under any strategy (ddp included: only its validation, test and predict loops take one loader after"
            f" the other). Combine training loaders in one of the modes {', '.join(repr(m) for m in COMBINED_MODES)}."
        )
    if mode not in COMBINED_MODES:
        raise ValueError(f"{loaders} training loaders combined in an unknown mode {mode!r}")


def lead_index(mode: str, batches: Sequence[int]) -> int:
    """Which loader leads: the one with the most batches (the first such), or the fewest under ``"min_size"``."""
    check_mode(mode, len(batches))
    target = min(batches) if mode == "min_size" else max(batches)
    return list(batches).index(target)


def follower_map(mode: str, own_batches: int) -> Callable[[int], int | None]:
    """A follower's batch for the lead's plan batch ``b`` (``None``: it has none)."""
    if mode == "max_size_cycle":
        return lambda b: b % own_batches
    if mode == "max_size":
        return lambda b: b if b < own_batches else None
    return lambda b: b
