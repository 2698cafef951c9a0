"""The fit's training loaders: each built over the user's, and started at every epoch; when ``train_dataloader``
returns several (a dict or list: Lightning's ``CombinedLoader``) one leads the plan and the others follow it
(``core/combined.py``). Building and starting are local work whose failure on one rank is raised on every rank
(``every_rank.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy
from torch.utils.data import DataLoader

from lightning_oscars.core.combined import follower_map, lead_index
from lightning_oscars.core.loader import EpochOrder, LoadBalancedLoader
from lightning_oscars.core.partition import EpochPlan
from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.epoch_draw import shared_epoch_order
from lightning_oscars.lightning.every_rank import on_every_rank

__all__ = ["build_loader", "lead_loader", "start_loaders"]


def build_loader(
    strategy: ParallelStrategy, trainer: Trainer, dataloader: object, seed: int | None, **place: Any
) -> LoadBalancedLoader:
    """The load-balanced loader over the user's training loader (``place``: the rank's ``rank``, ``world_size``,
    ``replica_size``, ``member`` and ``batch_sizes``), agreed on by every rank: one rank's failure to build it (or a
    training set of another size) is every rank's error, before Lightning's next collective."""

    def build() -> LoadBalancedLoader:
        if not isinstance(dataloader, Iterable):
            raise ValueError(f"strategy='oscars' needs an iterable for training, got {type(dataloader).__name__}")
        batches_per_slot, unwrap = internals.accumulation_at(trainer, trainer.current_epoch), internals.unwrap_sampler
        # An iterable of its own batches (not a DataLoader) has no sampler: its order is its own (own_batches.py).
        order = None if not isinstance(dataloader, DataLoader) else EpochOrder.of_loader(dataloader, seed, unwrap)
        return LoadBalancedLoader(dataloader, batches_per_slot=batches_per_slot, order=order, **place)

    return on_every_rank(strategy, "building the training loader", build, agree=_units_of)


def _units_of(loader: LoadBalancedLoader) -> str:
    if loader.shape == "own":
        return f"{loader.num_batches // loader.world_size} batches per pass"
    unit = "samples" if loader.shape == "samples" else "batches of the user's"
    return f"{loader.num_samples} {unit} in {loader.num_batches} batches"


def lead_loader(trainer: Trainer, fallback: LoadBalancedLoader) -> tuple[LoadBalancedLoader, list[LoadBalancedLoader]]:
    """The loader that leads the plan and its followers, each told whom it follows (the same on every rank: every rank
    has the same loaders). One loader (or none of ours yet): ``fallback`` alone."""
    loaders = [loader for loader in internals.training_loaders(trainer) if isinstance(loader, LoadBalancedLoader)]
    if len(loaders) <= 1:
        return (loaders[0] if loaders else fallback), []
    mode = internals.combined_mode(trainer)
    lead = loaders[lead_index(mode, [loader.num_batches for loader in loaders])]
    lead.lead = None
    followers = [loader for loader in loaders if loader is not lead]
    for follower in followers:
        if follower.widths is not None or lead.widths is not None:
            raise ValueError(
                "batch_sizes cannot apply to several training loaders combined in one step: oscars splits their steps"
                " together. Remove batch_sizes, or combine the data sets into one DataLoader."
            )
        follower.lead, follower.follow = lead, follower_map(mode, follower.num_batches)
    return lead, followers


def start_loaders(
    strategy: ParallelStrategy,
    lead: LoadBalancedLoader,
    followers: Sequence[LoadBalancedLoader],
    epoch: int,
    order: Sequence[Any] | None,
    resume_at: int,
    plan_epoch: Callable[[], EpochPlan],
) -> EpochPlan:
    """Plan ``epoch`` (``plan_epoch``) and start the loaders on it: the lead with ``order`` (a recovered epoch's; else
    the lead's own, drawn on rank 0 and shared when it is a custom sampler's), each follower with the lead's plan,
    length and start and its own order (likewise). The orders are drawn first (collectives); planning and starting
    are local, and one rank's failure there is every rank's."""
    if order is None and lead.order.shared:
        order = shared_epoch_order(strategy, lead.order, epoch)
    orders = [shared_epoch_order(strategy, f.order, epoch) if f.order.shared else None for f in followers]

    def plan_and_start() -> EpochPlan:
        plan = plan_epoch()
        lead.start_epoch(plan, epoch, order, start_position=resume_at)
        for follower, own in zip(followers, orders):
            if follower.batches_per_slot != lead.batches_per_slot:
                follower.set_batches_per_slot(lead.batches_per_slot)
            follower.max_slots = lead.max_slots
            follower.start_epoch(plan, epoch, own, start_position=resume_at)
        return plan

    return on_every_rank(strategy, f"starting training epoch {epoch}", plan_and_start)
