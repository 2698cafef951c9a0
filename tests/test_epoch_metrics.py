"""align_epoch_metrics in one process: two ranks' result collections, one logged values the other never did (a value
logged only at some batch_idx, which a slow rank skips) and in another order."""

from __future__ import annotations

import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

from lightning_oscars.lightning.epoch_metrics import align_epoch_metrics, synced_epoch_keys


def _no_sync(value, *args, **kwargs):
    return value


def _log(results: _ResultCollection, name: str, value: float, reduce_fx: str = "mean", sync: bool = True) -> None:
    results.log(
        "training_step",
        name,
        torch.tensor(value),
        on_step=False,
        on_epoch=True,
        reduce_fx=reduce_fx,
        sync_dist=sync,
        sync_dist_fn=_no_sync,
        batch_size=4,
    )


def test_every_rank_ends_with_the_same_synced_values_in_the_same_order():
    fast, slow = _ResultCollection(training=True), _ResultCollection(training=True)
    _log(fast, "loss", 1.0)
    _log(fast, "rare", 2.0, "sum")
    _log(fast, "local", 5.0, sync=False)  # not reduced across ranks: not exchanged
    _log(slow, "peak", 3.0, "max")
    _log(slow, "loss", 0.5)
    everyone = [synced_epoch_keys(fast), synced_epoch_keys(slow)]
    assert sorted(everyone[0]) == ["training_step.loss", "training_step.rare"]

    added_fast = align_epoch_metrics(fast, lambda mine: everyone, _no_sync, torch.device("cpu"))
    added_slow = align_epoch_metrics(slow, lambda mine: everyone, _no_sync, torch.device("cpu"))
    assert added_fast == ["training_step.peak"] and added_slow == ["training_step.rare"]

    synced = ["training_step.loss", "training_step.peak", "training_step.rare"]
    assert [k for k in fast if k in synced] == [k for k in slow if k in synced] == synced
    # Registered values contribute nothing to the reductions.
    assert fast["training_step.peak"].value.item() == float("-inf")
    assert slow["training_step.rare"].value.item() == 0.0
    assert fast["training_step.peak"].meta.is_max_reduction
    assert "training_step.local" in fast and "training_step.local" not in slow
    # What the rank had logged is untouched.
    assert fast["training_step.loss"].value.item() == 4.0 and fast["training_step.loss"].cumulated_batch_size == 4


def test_a_mean_registered_with_no_samples_leaves_the_mean_of_the_others():
    fast, slow = _ResultCollection(training=True), _ResultCollection(training=True)
    _log(fast, "rare", 2.0)
    everyone = [synced_epoch_keys(fast), synced_epoch_keys(slow)]
    align_epoch_metrics(slow, lambda mine: everyone, _no_sync, torch.device("cpu"))
    placeholder, real = slow["training_step.rare"], fast["training_step.rare"]
    total = (placeholder.value + real.value) / (placeholder.cumulated_batch_size + real.cumulated_batch_size)
    assert total.item() == 2.0
