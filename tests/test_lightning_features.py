"""Lightning features under unequal speeds, 2 ranks (gloo) through Lightning's launcher: each test reproduces a way
oscars used to break a user's run (lost gradients, ignored samplers, stale hooks, crashes) and asserts what ddp
would give. Every run has the hard timeout of ``run_case``."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from test_multiprocess import finished, run_case

pytestmark = pytest.mark.multiprocess


def test_partial_units_and_an_accumulation_schedule(tmp_path, tmp_path_factory):
    # Epoch 0: 10 batches in units of 4, local steps [2, 1]: rank 0 trains unit 0 and the 2-batch unit 2. ddp
    # applies a partial unit at the epoch's last batch; so must oscars (it used to zero those gradients unapplied).
    fast, slow = finished("accumulation", tmp_path, tmp_path_factory)
    assert (fast["seen_per_epoch"][0], fast["steps_per_epoch"][0]) == (96, 2)
    assert (slow["seen_per_epoch"][0], slow["steps_per_epoch"][0]) == (64, 1)
    # Epoch 1: the GradientAccumulationScheduler makes units of 2 batches (the loader kept units of 4, and a rank
    # trained with no optimizer step): each sample once, one optimizer step per unit on both ranks.
    assert fast["seen_per_epoch"][1] + slow["seen_per_epoch"][1] == 160
    for rank in (fast, slow):
        assert rank["steps_per_epoch"][1] == rank["seen_per_epoch"][1] // 32 > 0


def test_a_custom_sampler_is_honoured(tmp_path, tmp_path_factory):
    # WeightedRandomSampler: sample 0 weighs 1000 of 1099, 100 draws with replacement per epoch. Its draws are
    # split between the ranks by speed (ddp: ~91 of 100 draws are sample 0; the old oscars drew it once).
    fast, slow = finished("weighted_sampler", tmp_path, tmp_path_factory)
    for epoch in (0, 1):
        drawn = fast["trained"][epoch] + slow["trained"][epoch]
        assert len(drawn) == 100
        assert drawn.count(0) > 70, drawn.count(0)
        assert len(fast["trained"][epoch]) > len(slow["trained"][epoch])


def test_checkpoint_writes_are_not_timed_as_steps(tmp_path):
    # A 0.15 s checkpoint write every 20 steps on a 1x/3x cluster once made the schedule wander ((3,1) -> (6,1)
    # -> (7,2) -> (2,3) ...), with rounds where the fast rank took fewer steps than the slow one.
    fast, slow = finished("slow_checkpoint_write", tmp_path)
    assert len(list((tmp_path / "steps").glob("*.ckpt"))) >= 3
    solved = [h for h in fast["history"] if h["round"] > 1]
    assert solved, fast["history"]
    assert all(h["local_steps"][0] >= 2 * h["local_steps"][1] for h in solved), [h["local_steps"] for h in solved]
    # Nor as a round's fixed cost: the write (rank 0) and Lightning's barrier after it (rank 1 waits there) made
    # a round with a write read as 0.15 s of all-reduce; once such rounds filled half the window of recent costs,
    # the cost-aware solver lengthened the rounds ([9, 3] -> [11, 4] -> [9, 3]).
    for rank in (fast, slow):
        assert max(rank["round_costs"]) < 0.1, rank["round_costs"]
    changes = sum(1 for h in fast["history"] if h["rebalanced"])
    assert changes <= 3, [h["local_steps"] for h in fast["history"]]


def _csv_rows(root: Path) -> list[dict[str, str]]:
    (path,) = root.rglob("metrics.csv")
    with path.open() as f:
        return list(csv.DictReader(f))


def test_builtin_callbacks_and_the_noop_slot_contract(tmp_path):
    # local_steps [1, 3]: rank 0 (the logging rank) is real in 1 slot of 3.
    noop_heavy, busy = finished("builtin_callbacks", tmp_path)
    # No-op slots: hooks see an empty batch and no outputs; real slots the batch and the loss.
    probe = noop_heavy["probe"]
    assert len(probe) == noop_heavy["global_step"]
    assert all(entry == [True, 16, ["loss"]] for entry in probe[::3])
    assert all(entry == [False, 0, []] for i, entry in enumerate(probe) if i % 3)
    assert all(entry[:2] == [True, 16] for entry in busy["probe"])
    # Loggers get a training step's values only when that step ran (they used to re-log the last real one).
    rows = _csv_rows(tmp_path / "csv")
    assert sum(1 for r in rows if r.get("train_loss_step")) == noop_heavy["steps_taken"]
    # LearningRateMonitor logs every step; the step-interval StepLR advanced on every slot of every rank.
    assert sum(1 for r in rows if r.get("lr-SGD")) == noop_heavy["global_step"]
    expected_lr = 0.1 * 0.5 ** (noop_heavy["global_step"] // 5)
    assert noop_heavy["lr"] == busy["lr"] == [pytest.approx(expected_lr)]
    # ThroughputMonitor counts the samples this rank trained on.
    assert noop_heavy["throughput_samples"] == noop_heavy["seen"]
    # ModelCheckpoint(every_n_train_steps=7) saved at the same steps everywhere (a mismatch would hang).
    saved = sorted(int(p.stem.split("step=")[1]) for p in (tmp_path / "steps").glob("*.ckpt"))
    assert saved == list(range(7, noop_heavy["global_step"] + 1, 7))
    # A sync_dist epoch value that rank 0 never logged (batch_idx % 3 == 1) is reduced without a hang, over the
    # rank that logged it.
    assert noop_heavy["metrics"]["rare"] == busy["metrics"]["rare"] == 1.0
    # EMAWeightAveraging copied the (rank-averaged) EMA into the model at the end: identical on both ranks,
    # checked by finished().


def test_swa_with_an_accumulation_change(tmp_path, tmp_path_factory):
    fast, slow = finished("swa_and_accumulation", tmp_path, tmp_path_factory)
    for epoch in range(3):
        assert fast["seen_per_epoch"][epoch] + slow["seen_per_epoch"][epoch] == 512


def test_optimizer_state_of_a_parameter_one_rank_never_trained_and_large_integers(tmp_path, tmp_path_factory):
    # Rank 1 never uses the head: its optimizer holds no state for it, so the ranks' state differs in layout.
    fast, slow = finished("optimizer_state_unused_head", tmp_path, tmp_path_factory)
    # An int64 buffer beyond 2^24, equal on every rank, comes back exact (a float32 buffer rounded it).
    assert fast["big"] == slow["big"] == [16777217, 123456789, -(2**62) - 1]


def test_optimizer_state_of_lbfgs(tmp_path, tmp_path_factory):
    # LBFGS replaces its state tensors every step (the averager compared tensors by value and raised).
    fast, slow = finished("optimizer_state_lbfgs", tmp_path, tmp_path_factory)
    assert fast["steps_taken"] > 0 and slow["steps_taken"] > 0


def test_fast_dev_run_works_with_default_options(tmp_path, tmp_path_factory):
    fast, slow = finished("fast_dev_run", tmp_path, tmp_path_factory)
    assert fast["global_step"] == slow["global_step"] == 1


def test_batch_size_finder_fails_clearly(tmp_path):
    results = run_case("batch_size_finder", tmp_path)
    for r in results:
        assert "not supported with distributed strategies" in r.get("error", ""), r.get("error")


def test_save_checkpoint_in_the_main_process_after_a_spawned_fit(tmp_path):
    (main,) = run_case("spawn_then_save", tmp_path, ranks=(0,))
    assert "error" not in main, main["error"]
    assert main["saved"]
