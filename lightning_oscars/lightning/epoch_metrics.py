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

__all__ = ["StepValueAgreement", "align_epoch_metrics", "module_metric", "synced_epoch_keys"]

# What a rank that never logged a value contributes to each reduction: nothing.
_NEUTRAL = {"mean": 0.0, "sum": 0.0, "max": float("-inf"), "min": float("inf")}


def _reduction(metric: _ResultMetric) -> str | None:
    meta = metric.meta
    for name in ("mean", "sum", "max", "min"):
        if getattr(meta, f"is_{name}_reduction"):
            return name
    return None


def module_metric(module: torch.nn.Module, attribute: str) -> Metric | None:
    """The ``Metric`` of ``module`` at ``attribute`` (a ``named_modules`` path, as Lightning records it), or
    ``None``."""
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


def _register_missing(
    results: _ResultCollection,
    key: str,
    fields: dict[str, Any],
    reduce_fn: Callable[..., Any],
    device: torch.device,
    metric_of: Callable[[str], Metric | None],
) -> None:
    """Log ``key`` on this rank as another rank logged it, holding its reduction's identity (or the module's own,
    never updated, ``Metric``), so that this rank takes part in its epoch-end reduction adding nothing."""
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
        _register_missing(results, key, everyone[key], reduce_fn, device, metric_of)
        added.append(key)
    # One order on every rank: the values reduced at the epoch end last, sorted by key.
    synced = sorted(key for key in everyone if key in results)
    rest = [(key, metric) for key, metric in results.items() if key not in everyone]
    ordered = rest + [(key, results[key]) for key in synced]
    results.clear()
    results.update(ordered)
    return added


# ---------------------------------------------------------------------------------------------------------- step values
#
# ``self.log(..., on_step=True, sync_dist=True)`` inside a local step stays rank-local (ranks run different numbers of
# steps, so the per-step reduction could never be matched). Callbacks that decide on such a value (ModelCheckpoint's
# top-k and file names, EarlyStopping) must still decide alike on every rank: at the points where they read it (a
# validation, an epoch end, a step that saves a checkpoint; the same batch on every rank), the ranks agree on each
# value, reduced as ``reduce_fx`` says over every rank's latest step value.

_REDUCE: dict[str, Callable[[list[float]], float]] = {
    "mean": lambda values: sum(values) / len(values),
    "sum": sum,
    "max": max,
    "min": min,
}


def _step_name(metric: _ResultMetric) -> str:
    """The callback-metric name of a value's step figure (``name_step`` when it is also logged per epoch)."""
    return f"{metric.meta.name}_step" if metric.meta.on_epoch else metric.meta.name


def _step_metrics(results: _ResultCollection) -> list[_ResultMetric]:
    return [
        metric
        for metric in results.values()
        if isinstance(metric, _ResultMetric)
        and metric.is_tensor
        and metric.meta.on_step
        and metric.meta.sync.should
        and not metric.meta.sync.rank_zero_only
        and _reduction(metric) is not None
        and isinstance(metric._forward_cache, torch.Tensor)
        and metric._forward_cache.numel() == 1
    ]


class StepValueAgreement:
    """Agrees on the step values, round after round of one fit. A value agreed at one point and not logged again
    before the next is still this rank's own latest value there: the rank contributes what it logged, never the
    agreed figure (a ``sum`` would otherwise grow at every agreement)."""

    def __init__(self) -> None:
        self._agreed: dict[int, tuple[torch.Tensor, float]] = {}  # id(result metric) -> (agreed cache, own value)

    def _own(self, metric: _ResultMetric) -> float:
        cache = metric._forward_cache
        assert isinstance(cache, torch.Tensor)
        agreed = self._agreed.get(id(metric))
        if agreed is not None and agreed[0] is cache:
            return agreed[1]
        return float(cache)

    def step_values(self, results: _ResultCollection) -> dict[str, tuple[str, float]]:
        """This rank's latest step value of every ``on_step`` ``sync_dist`` tensor: name -> (reduction, value)."""
        return {_step_name(m): (_reduction(m) or "mean", self._own(m)) for m in _step_metrics(results)}

    def agree(
        self,
        results: _ResultCollection,
        everyone: list[dict[str, tuple[str, float]]],
        callback_metrics: dict[str, Any],
    ) -> dict[str, float]:
        """Set every rank's step values to one agreed figure, from every rank's :meth:`step_values` (``everyone``, in
        rank order: the same list on every rank): in ``results`` (what ``trainer.callback_metrics`` is built from
        during an epoch) and in ``callback_metrics`` (Lightning's store of them, read at validation and epoch ends).
        A value some rank never logged is reduced over the ranks that did. Returns the agreed figures."""
        agreed: dict[str, float] = {}
        for name in sorted({name for values in everyone for name in values}):
            held = [values[name] for values in everyone if name in values]
            agreed[name] = float(_REDUCE[held[0][0]]([value for _, value in held]))
        for metric in _step_metrics(results):
            name = _step_name(metric)
            if name in agreed:
                cache = metric._forward_cache
                assert isinstance(cache, torch.Tensor)
                own = self._own(metric)
                metric._forward_cache = torch.tensor(agreed[name], dtype=cache.dtype, device=cache.device)
                self._agreed[id(metric)] = (metric._forward_cache, own)
                if not metric.meta.on_epoch:  # a step-only value is its own epoch figure
                    metric.value = metric._forward_cache
        for name, value in agreed.items():
            old = callback_metrics.get(name)
            like = old if isinstance(old, torch.Tensor) else torch.tensor(0.0)
            callback_metrics[name] = torch.tensor(value, dtype=like.dtype, device=like.device)
        return agreed
