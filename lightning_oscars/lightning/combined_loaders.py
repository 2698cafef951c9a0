"""The fit's training loaders when ``train_dataloader`` returns several (a dict or list: Lightning's
``CombinedLoader``): one leads the plan, the others follow it (``core/combined.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy

from lightning_oscars.core.combined import follower_map, lead_index
from lightning_oscars.core.loader import LoadBalancedLoader
from lightning_oscars.core.partition import EpochPlan
from lightning_oscars.lightning import _internals as internals
from lightning_oscars.lightning.epoch_draw import shared_epoch_order

__all__ = ["lead_loader", "start_followers"]


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


def start_followers(
    strategy: ParallelStrategy,
    lead: LoadBalancedLoader,
    followers: Sequence[LoadBalancedLoader],
    plan: EpochPlan,
    epoch: int,
    resume_at: int,
) -> None:
    """Hand each follower the lead's epoch: its plan, length and start, and the follower's own order of samples (a
    custom sampler's drawn on rank 0 and shared, as the lead's)."""
    for follower in followers:
        if follower.batches_per_slot != lead.batches_per_slot:
            follower.set_batches_per_slot(lead.batches_per_slot)
        follower.max_slots = lead.max_slots
        order = shared_epoch_order(strategy, follower.order, epoch) if follower.order.shared else None
        follower.start_epoch(plan, epoch, order, start_position=resume_at)
