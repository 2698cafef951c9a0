"""The adapter's patches and its reads and writes of Lightning's state, against a real Trainer and Lightning's own
validation check."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_oscars.lightning.adapter import LightningAdapter
from lightning_oscars.lightning.tuner_patch import LRFinderSlots


def _validated_batches(trainer: pl.Trainer, adapter: LightningAdapter, length: int, resize: dict[int, int]) -> list:
    """Walk one epoch of ``length`` batches as the training loop does; ``resize`` maps a batch index to the epoch's new
    length at that batch's end (a re-solved schedule). Returns the 1-based batches Lightning's own check validates."""
    loop = trainer.fit_loop.epoch_loop
    loop._should_check_val_epoch = lambda: True  # type: ignore[method-assign]  # no model attached: validation is on
    adapter.read_epoch(trainer)  # as the session plans the epoch: where it validates, read once
    adapter.size_epoch(trainer, length)
    validated, batch_idx = [], 0
    while batch_idx < trainer.num_training_batches:
        loop.batch_progress.current.ready = batch_idx + 1  # Lightning's batch_idx is ready - 1
        loop.batch_progress.is_last_batch = batch_idx + 1 == trainer.num_training_batches
        _batch_ends(adapter, batch_idx)
        if batch_idx in resize:
            adapter.size_epoch(trainer, resize[batch_idx], mid_epoch=True)
        adapter.pace_validation(trainer, batch_idx)
        if loop._should_check_val_fx(data_fetcher=None):  # type: ignore[arg-type]
            validated.append(batch_idx + 1)
        batch_idx += 1
    return validated


@pytest.mark.parametrize(
    ("interval", "length", "resize", "expected"),
    [
        (0.5, 100, {}, [50, 100]),  # no re-size: Lightning's own points
        (0.5, 100, {39: 61}, [50, 61]),  # cut before the first validation: both still run, the last at the end
        (0.5, 100, {59: 130}, [50, 130]),  # grown after the first: only the end is left
        (0.5, 100, {19: 130, 59: 90}, [75, 90]),  # re-sized twice: the second keeps the first's one left
        (0.25, 100, {54: 200}, [25, 50, 127, 200]),  # two left of four, spread over the grown rest
        (1.0, 100, {10: 37}, [37]),  # once per epoch: at its new end
    ],
)
def test_a_resized_epoch_validates_as_often_as_planned(interval, length, resize, expected):
    trainer = pl.Trainer(val_check_interval=interval, logger=False, enable_checkpointing=False, devices=1)
    adapter = LightningAdapter(lambda: True, torch.device("cpu"))
    validated = _validated_batches(trainer, adapter, length, resize)
    assert validated == expected


@pytest.mark.parametrize(
    ("interval", "length", "resize"),
    [(0.5, 100, {}), (0.25, 100, {}), (0.5, 100, {39: 61}), (0.5, 100, {19: 130, 59: 90}), (0.25, 100, {54: 200})],
)
def test_validation_slots_predict_where_lightning_validates(interval, length, resize, monkeypatch):
    # What the round plan is told (EpochPlan.boundaries), against what Lightning's own check does: every validation
    # before the epoch's end, also where a re-plan re-sizes the running epoch (asked before the adapter re-sizes it),
    # and in the next epoch, whose plan is made before Lightning is told its length (the last epoch's re-sized
    # points must not leak into it).
    monkeypatch.setattr(pl.Trainer, "enable_validation", property(lambda self: True))
    trainer = pl.Trainer(val_check_interval=interval, logger=False, enable_checkpointing=False, devices=1)
    adapter = LightningAdapter(lambda: True, torch.device("cpu"))
    for epoch_length, epoch_resize in ((length, resize), (length - 7, {})):
        predicted, validated = _predicted_and_validated(trainer, adapter, epoch_length, epoch_resize)
        assert predicted == [v for v in validated if v < trainer.num_training_batches]
        assert predicted  # the cases all validate inside the epoch


def _batch_ends(adapter: LightningAdapter, batch_idx: int) -> None:
    """What the session tells the epoch's validation at every batch's end, before a re-plan may re-size the epoch."""
    if adapter.epoch.validation is not None:
        adapter.epoch.validation.at_batch(batch_idx)


def _predicted_and_validated(
    trainer: pl.Trainer, adapter: LightningAdapter, length: int, resize: dict[int, int]
) -> tuple[list[int], list[int]]:
    """One epoch planned and walked as the strategy does: the slots the plan is told at the epoch's start (updated
    where ``resize`` re-sizes the epoch), and the 1-based batches Lightning's own check validates."""
    points = adapter.read_epoch(trainer).boundaries
    assert points is not None
    predicted = list(points(length))
    loop = trainer.fit_loop.epoch_loop
    loop._should_check_val_epoch = lambda: True  # type: ignore[method-assign]
    adapter.size_epoch(trainer, length)
    validated, batch_idx = [], 0
    while batch_idx < trainer.num_training_batches:
        loop.batch_progress.current.ready = batch_idx + 1
        loop.batch_progress.is_last_batch = batch_idx + 1 == trainer.num_training_batches
        _batch_ends(adapter, batch_idx)
        if batch_idx in resize:
            ahead = [p for p in points(resize[batch_idx]) if p > batch_idx + 1]
            predicted = [p for p in predicted if p <= batch_idx + 1] + ahead
            adapter.size_epoch(trainer, resize[batch_idx], mid_epoch=True)
        adapter.pace_validation(trainer, batch_idx)
        if loop._should_check_val_fx(data_fetcher=None):  # type: ignore[arg-type]
            validated.append(batch_idx + 1)
        batch_idx += 1
    return predicted, validated


def test_validation_slots_are_none_when_the_epoch_does_not_validate_by_its_own_batches(monkeypatch):
    monkeypatch.setattr(pl.Trainer, "enable_validation", property(lambda self: True))
    adapter = LightningAdapter(lambda: True, torch.device("cpu"))
    for options in ({"check_val_every_n_epoch": None, "val_check_interval": 10}, {"check_val_every_n_epoch": 2}):
        trainer = pl.Trainer(logger=False, enable_checkpointing=False, devices=1, **options)  # epoch 0 of 2: none
        assert adapter.read_epoch(trainer).boundaries is None
    trainer = pl.Trainer(
        val_check_interval=7, accumulate_grad_batches=2, logger=False, enable_checkpointing=False, devices=1
    )
    shape = adapter.read_epoch(trainer)
    assert shape.batches_per_slot == 2 and shape.boundaries is not None
    assert shape.boundaries(20) == (4, 7, 11, 14, 18)  # batches 7, 14, ...: the slots holding them
    monkeypatch.setattr(pl.Trainer, "enable_validation", property(lambda self: False))
    assert adapter.read_epoch(trainer).boundaries is None


_SIGTERM_SCRIPT = """
import os, signal, sys, time
from types import SimpleNamespace
from lightning_oscars.lightning.patches import Patches
from lightning_oscars.lightning.signal_patch import DeferredSignals

trainer = SimpleNamespace(
    _signal_connector=SimpleNamespace(_original_handlers={}),
    _accelerator_connector=SimpleNamespace(cluster_environment=None),
)
DeferredSignals().install(trainer, Patches(), lambda: print("deferred", flush=True), lambda: None)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("alive", flush=True)  # the first one waits for the round boundary
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("still alive", flush=True)
"""


def test_a_second_sigterm_ends_the_process_at_once():
    # The first SIGTERM is deferred to the round boundary (every rank stops at one batch); a rank blocked in a
    # collective never reaches it, so a second SIGTERM takes the default action, as without oscars.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _SIGTERM_SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["deferred", "alive"], done.stdout + done.stderr
    assert done.returncode == -15, done.returncode


def test_the_lr_finder_sees_no_loss_on_a_no_op_slot_and_broadcasts_once_there():
    """Other callbacks see a no-op slot's repeated outputs; the LR finder's hook must see none (it then records a NaN
    and returns before its own broadcast), or the no-op rank would broadcast twice and the ranks would hang."""
    real = [True]
    finder = LRFinderSlots(lambda: real[0])
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    broadcasts: list[bool] = []
    trainer.strategy.broadcast = lambda obj, src=0: broadcasts.append(obj) or obj  # type: ignore[method-assign]
    seen: list[object] = []

    def hook(trainer, pl_module, outputs, batch, batch_idx):  # the finder's: it broadcasts only after a real loss
        seen.append(outputs)
        if outputs:
            trainer.should_stop = trainer.strategy.broadcast(trainer.should_stop)

    wrapped = finder.broadcast_on_noop_slots(hook)
    wrapped(trainer, None, {"loss": torch.tensor(1.0)}, None, 0)
    real[0] = False
    wrapped(trainer, None, {"loss": torch.tensor(1.0)}, None, 1)  # the repeated outputs of a no-op slot
    wrapped(trainer, None, outputs={"loss": torch.tensor(1.0)}, batch=None, batch_idx=2)
    assert [bool(o) for o in seen] == [True, False, False]
    assert len(broadcasts) == 3  # one per slot, real or not
