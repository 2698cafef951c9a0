"""Matching the epoch-end reductions of ``self.log(..., on_epoch=True, sync_dist=True)`` across ranks.

Lightning reduces every epoch-level ``sync_dist`` value with one collective per value, in the order the values
were first logged. Under oscars ranks run different batches: a value logged only at some ``batch_idx`` may never
be logged on a slow rank, or be logged first in another order, and the epoch-end collectives would then pair
different values (wrong numbers) or wait forever (a hang). A ``torchmetrics.Metric`` logged with ``on_epoch=True``
synchronises itself when Lightning computes it at the epoch end (one gather per state), so it is a collective in the
same sequence. :func:`align_epoch_metrics` runs at the epoch end, before Lightning reduces: the ranks exchange the keys
they hold, every rank registers the ones it lacks (a tensor with a neutral value, a ``Metric`` as the module's own,
never updated there: its default states are its reduction's identity), and all put them in one order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection, _ResultMetric
from torchmetrics import Metric

__all__ = ["align_epoch_metrics", "module_metric", "synced_epoch_keys"]

# What a rank that never logged a value contributes to each reduction: nothing.
_NEUTRAL = {"mean": 0.0, "sum": 0.0, "max": float("-inf"), "min": float("inf")}


def _reduction(metric: _ResultMetric) -> str | None:
    meta = metric.meta
    for name in ("mean", "sum", "max", "min"):
        if getattr(meta, f"is_{name}_reduction"):
            return name
    return None


def module_metric(module: torch.nn.Module, attribute: str) -> Metric | None:
    """The ``Metric`` at ``attribute`` (a ``named_modules`` path, as Lightning records it) of ``module``, or ``None``."""
    try:
        found = module.get_submodule(attribute)
    except AttributeError:
        return None
    return found if isinstance(found, Metric) else None


def _syncs_itself(metric: _ResultMetric) -> bool:
    """A logged ``torchmetrics.Metric`` that gathers its states across ranks when it is computed."""
    value = metric.value
    return isinstance(value, Metric) and bool(getattr(value, "sync_on_compute", True))


def synced_epoch_keys(results: _ResultCollection) -> dict[str, dict[str, Any]]:
    """The values this rank holds that will meet the other ranks' at the epoch end (tensors Lightning reduces,
    ``Metric`` objects that synchronise themselves), each with what another rank needs to register it (plain,
    picklable fields)."""
    keys: dict[str, dict[str, Any]] = {}
    for key, metric in results.items():
        if not isinstance(metric, _ResultMetric) or metric.has_reset:
            continue
        meta = metric.meta
        is_metric = not metric.is_tensor
        if not meta.on_epoch or not (_syncs_itself(metric) if is_metric else meta.sync.should):
            continue
        if is_metric and meta.metric_attribute is None:  # not the module's attribute: another rank cannot find it
            continue
        reduction = _reduction(metric)
        if reduction is None:  # a custom reduce_fx cannot be given a neutral value; leave it as the user logged it
            continue
        keys[key] = {
            "metric": is_metric,
            "sync_dist": meta.sync.should,
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
    metric_of: Callable[[str], Metric | None] = lambda attribute: None,
) -> list[str]:
    """Give every rank the same epoch-level ``sync_dist`` values and self-synchronising metrics, in the same order.

    Args:
        results: this rank's training result collection (``trainer._results``).
        gather: exchanges this rank's :func:`synced_epoch_keys` with every rank (one collective, on all ranks).
        reduce_fn: the strategy's ``reduce``, which Lightning calls for each value.
        device: where a registered value lives.
        metric_of: the module's ``Metric`` at an attribute path (``LightningModule.log``'s ``metric_attribute``).

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
        value: torch.Tensor | Metric | None = torch.tensor(_NEUTRAL[fields["reduce_fx"]], device=device)
        if fields["metric"]:
            value = metric_of(fields["metric_attribute"])
            if value is None:
                raise RuntimeError(
                    f"Another rank logged the metric {fields['metric_attribute']!r} (as {fields['name']!r}), which this"
                    " rank's LightningModule does not have: under oscars every rank must hold the same metrics."
                )
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
            sync_dist=fields["sync_dist"],
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
