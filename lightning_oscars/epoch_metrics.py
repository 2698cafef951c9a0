"""Matching the epoch-end reductions of ``self.log(..., on_epoch=True, sync_dist=True)`` across ranks.

Lightning reduces every epoch-level ``sync_dist`` value with one collective per value, in the order the values
were first logged. Under oscars ranks run different batches: a value logged only at some ``batch_idx`` may never
be logged on a slow rank, or be logged first in another order, and the epoch-end collectives would then pair
different values (wrong numbers) or wait forever (a hang). :func:`align_epoch_metrics` runs at the epoch end,
before Lightning reduces: the ranks exchange the keys they hold, every rank registers the ones it lacks with a
neutral value (nothing trained on them there), and all put them in one order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection, _ResultMetric

__all__ = ["align_epoch_metrics", "synced_epoch_keys"]

# What a rank that never logged a value contributes to each reduction: nothing.
_NEUTRAL = {"mean": 0.0, "sum": 0.0, "max": float("-inf"), "min": float("inf")}


def _reduction(metric: _ResultMetric) -> str | None:
    meta = metric.meta
    for name in ("mean", "sum", "max", "min"):
        if getattr(meta, f"is_{name}_reduction"):
            return name
    return None


def synced_epoch_keys(results: _ResultCollection) -> dict[str, dict[str, Any]]:
    """The tensor values this rank holds that Lightning will reduce across ranks at the epoch end, each with
    what another rank needs to register it (plain, picklable fields)."""
    keys: dict[str, dict[str, Any]] = {}
    for key, metric in results.items():
        if not isinstance(metric, _ResultMetric) or not metric.is_tensor or metric.has_reset:
            continue
        meta = metric.meta
        if not (meta.on_epoch and meta.sync.should):
            continue
        reduction = _reduction(metric)
        if reduction is None:  # a custom reduce_fx cannot be given a neutral value; leave it as the user logged it
            continue
        keys[key] = {
            "fx": meta.fx,
            "name": meta.name,
            "prog_bar": meta.prog_bar,
            "logger": meta.logger,
            "on_step": meta.on_step,
            "on_epoch": meta.on_epoch,
            "reduce_fx": reduction,
            "add_dataloader_idx": meta.add_dataloader_idx,
            "metric_attribute": meta.metric_attribute,
            "rank_zero_only": meta.sync.rank_zero_only,
        }
    return keys


def align_epoch_metrics(
    results: _ResultCollection,
    gather: Callable[[dict[str, dict[str, Any]]], list[dict[str, dict[str, Any]]]],
    reduce_fn: Callable[..., Any],
    device: torch.device,
) -> list[str]:
    """Give every rank the same epoch-level ``sync_dist`` values in the same order.

    Args:
        results: this rank's training result collection (``trainer._results``).
        gather: exchanges this rank's :func:`synced_epoch_keys` with every rank (one collective, on all ranks).
        reduce_fn: the strategy's ``reduce``, which Lightning calls for each value.
        device: where a registered value lives.

    Returns the keys this rank lacked and registered.
    """
    everyone: dict[str, dict[str, Any]] = {}
    for keys in gather(synced_epoch_keys(results)):
        for key, fields in keys.items():
            everyone.setdefault(key, fields)
    added = []
    for key in sorted(everyone):
        if key in results and not results[key].has_reset:
            continue
        fields = everyone[key]
        value = torch.tensor(_NEUTRAL[fields["reduce_fx"]], device=device)
        if key in results:  # logged in an earlier epoch, not in this one: reset; same metadata
            del results[key]
        results.log(
            fields["fx"],
            fields["name"],
            value,
            prog_bar=fields["prog_bar"],
            logger=fields["logger"],
            on_step=fields["on_step"],
            on_epoch=fields["on_epoch"],
            reduce_fx=fields["reduce_fx"],
            sync_dist=True,
            sync_dist_fn=reduce_fn,
            add_dataloader_idx=fields["add_dataloader_idx"],
            batch_size=0,
            metric_attribute=fields["metric_attribute"],
            rank_zero_only=fields["rank_zero_only"],
        )
        results[key]._forward_cache = None  # no step value: nothing was logged on this rank's steps
        added.append(key)
    # One order on every rank: the values reduced at the epoch end last, sorted by key.
    synced = sorted(key for key in everyone if key in results)
    rest = [(key, metric) for key, metric in results.items() if key not in everyone]
    ordered = rest + [(key, results[key]) for key in synced]
    results.clear()
    results.update(ordered)
    return added
