"""Lightning features under unequal speeds, 2 ranks (gloo) through Lightning's launcher: each test reproduces a way
oscars used to break a user's run (lost gradients, ignored samplers, stale hooks, crashes) and asserts what ddp
would give. Every run has the hard timeout of ``run_case``."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from test_multiprocess import _batched, case_dir, finished, refused, run_case

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


def test_checkpoint_writes_are_not_timed_as_steps(tmp_path, tmp_path_factory):
    # A 0.15 s checkpoint write every 20 steps on a 1x/3x cluster once made the schedule wander ((3,1) -> (6,1)
    # -> (7,2) -> (2,3) ...), with rounds where the fast rank took fewer steps than the slow one.
    fast, slow = finished("slow_checkpoint_write", tmp_path, tmp_path_factory)
    assert len(list((case_dir("slow_checkpoint_write") / "steps").glob("*.ckpt"))) >= 3
    solved = [h for h in fast["history"] if h["round"] > 1]
    assert solved, fast["history"]
    # No step time holds a 0.15 s write (the steps take a few ms), and the fast rank stays the busier in every round.
    assert max(t for h in fast["history"] for t in h["step_times"]) < 0.1, [h["step_times"] for h in fast["history"]]
    assert all(h["local_steps"][0] > h["local_steps"][1] for h in solved), [h["local_steps"] for h in solved]
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


def test_builtin_callbacks_and_the_noop_slot_contract(tmp_path, tmp_path_factory):
    # local_steps [1, 3]: rank 0 (the logging rank) is real in 1 slot of 3.
    noop_heavy, busy = finished("builtin_callbacks", tmp_path, tmp_path_factory)
    out = case_dir("builtin_callbacks")
    # No-op slots: hooks see an empty batch and the last real step's outputs (its loss); real slots the batch and loss.
    probe = noop_heavy["probe"]
    assert len(probe) == noop_heavy["global_step"]
    assert all(entry == [True, 16, ["loss"]] for entry in probe[::3])
    assert all(entry == [False, 0, ["loss"]] for i, entry in enumerate(probe) if i % 3)
    assert all(entry[:2] == [True, 16] for entry in busy["probe"])
    # Loggers get a training step's values only when that step ran (they used to re-log the last real one).
    rows = _csv_rows(out / "csv")
    assert sum(1 for r in rows if r.get("train_loss_step")) == noop_heavy["steps_taken"]
    # LearningRateMonitor logs every step; the step-interval StepLR advanced on every slot of every rank.
    assert sum(1 for r in rows if r.get("lr-SGD")) == noop_heavy["global_step"]
    expected_lr = 0.1 * 0.5 ** (noop_heavy["global_step"] // 5)
    assert noop_heavy["lr"] == busy["lr"] == [pytest.approx(expected_lr)]
    # ThroughputMonitor counts the samples this rank trained on.
    assert noop_heavy["throughput_samples"] == noop_heavy["seen"]
    # ModelCheckpoint(every_n_train_steps=7) saved at the same steps everywhere (a mismatch would hang).
    saved = sorted(int(p.stem.split("step=")[1]) for p in (out / "steps").glob("*.ckpt"))
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


def test_batch_size_finder_fails_clearly(tmp_path_factory):
    results = refused("batch_size_finder", tmp_path_factory)
    for r in results:
        assert "not supported with distributed strategies" in r.get("error", ""), r.get("error")


def test_save_checkpoint_in_the_main_process_after_a_spawned_fit(tmp_path):
    (main,) = run_case("spawn_then_save", tmp_path, ranks=(0,))
    assert "error" not in main, main["error"]
    assert main["saved"]


# ------------------------------------------------------------------ ordinary Lightning idioms, second round (issue 29)


def test_a_metric_object_logged_on_some_batches_only_syncs_on_every_rank_without_a_hang(tmp_path, tmp_path_factory):
    # local_steps [4, 1]: rank 1 trains at batch_idx % 4 == 0 only and never updates or logs the rare metric, whose
    # epoch value torchmetrics gathers from every rank: rank 0 alone in that gather used to hang until the timeout.
    fast, slow = finished("metric_rare", tmp_path, tmp_path_factory)
    assert all(count == 0 for _, count in slow["rare_sums"]) and all(count > 0 for _, count in fast["rare_sums"])
    total, count = fast["rare_sums"][-1]
    for rank in (fast, slow):  # MeanMetric over every update of the last epoch, on both ranks
        assert rank["metrics"]["rare_loss_epoch"] == pytest.approx(total / count, rel=1e-5)
        assert rank["metrics"]["every_loss_epoch"] == fast["metrics"]["every_loss_epoch"]


def test_checkpoint_and_early_stopping_decide_alike_on_a_monitored_step_value(tmp_path, tmp_path_factory):
    # train_loss is logged per step with sync_dist=True (rank-local inside a local step). ModelCheckpoint at
    # validation, at the epoch's end and every 5 steps, and EarlyStopping at validation and at the epoch's end,
    # used to keep a different best score, top-k and best path on every rank.
    fast, slow = finished("monitor_step_value", tmp_path, tmp_path_factory)
    state = fast["monitor_state"]
    assert state == slow["monitor_state"]
    assert fast["metrics"]["train_loss"] == slow["metrics"]["train_loss"]
    checkpoints = [v for k, v in state.items() if k.startswith("checkpoint")]
    assert len(checkpoints) == 3
    for checkpoint in checkpoints:
        assert checkpoint["best_k_models"] and checkpoint["best_model_path"] in checkpoint["best_k_models"]
        for path in checkpoint["best_k_models"]:  # the files rank 0 wrote are the ones every rank names
            assert Path(path).is_file(), path
            assert f"train_loss={checkpoint['best_k_models'][path]:.5f}" in path


def test_the_learning_rate_finder_runs_with_every_rank_stepping_and_the_fit_after_it_is_balanced(
    tmp_path, tmp_path_factory
):
    # Tuner.lr_find replaces trainer.callbacks for its loop: without oscars' callbacks it trained on empty batches
    # (19 of 20 losses NaN, no suggestion), and its LR callback broadcasts on real steps only (a hang).
    fast, slow = finished("lr_find", tmp_path, tmp_path_factory)
    found = fast["lr_find"]
    assert found == slow["lr_find"]
    assert found["suggestion"] is not None and found["lr"] == found["suggestion"] != 0.05
    assert len(found["losses"]) >= 10 and all(math.isfinite(loss) for loss in found["losses"])
    assert fast["lr"] == slow["lr"] == [found["suggestion"]]
    # The fit after it: its own rounds, profiled and balanced (rank 1 is 3x slower), every sample once.
    assert fast["schedule"][0] > fast["schedule"][1]
    assert fast["seen_per_epoch"][0] + slow["seen_per_epoch"][0] == 512


def test_an_epoch_mean_weighted_by_steps_is_the_mean_over_every_step(tmp_path, tmp_path_factory):
    # training_step_outputs kept per rank, their mean logged at the epoch end with sync_dist=True. The ranks train
    # unequal shares: plain means weigh each rank's mean alike; batch_size=len(outputs) weighs each step alike.
    fast, slow = finished("epoch_mean", tmp_path, tmp_path_factory)
    (fast_sum, fast_steps), (slow_sum, slow_steps) = fast["loss_sums"][-1], slow["loss_sums"][-1]
    per_step = (fast_sum + slow_sum) / (fast_steps + slow_steps)
    per_rank = (fast_sum / fast_steps + slow_sum / slow_steps) / 2
    # Unequal shares (rank 1 is slower), so that the two means differ and the test tells them apart; how unequal
    # depends on the machine's load, which a test must not assert.
    assert fast_steps > slow_steps and per_step != pytest.approx(per_rank, rel=1e-4)
    for rank in (fast, slow):
        metrics = rank["metrics"]
        assert metrics["mean_per_step"] == pytest.approx(per_step, rel=1e-5)
        assert metrics["mean_per_rank"] == pytest.approx(per_rank, rel=1e-5)


def test_limit_train_batches_trains_what_ddp_trains_and_validates_as_often(tmp_path, tmp_path_factory):
    # 512 samples in batches of 16: ddp gives each rank 16 batches, 0.25 of them is 4, so 128 samples per epoch,
    # validated after 2 and 4 batches. The plan used to be cut to 0.25 of its own slots (96 samples).
    fast, slow = finished("limit_quarter", tmp_path, tmp_path_factory)
    assert [a + b for a, b in zip(fast["seen_per_epoch"], slow["seen_per_epoch"])] == [128, 128]
    assert fast["validations_per_epoch"] == slow["validations_per_epoch"] == [2, 2]


def test_swa_batchnorm_epoch_past_the_plan_leaves_equal_weights(tmp_path, tmp_path_factory):
    # SWA's BatchNorm epoch runs one batch beyond the epoch's plan, where the pending accumulation step applies each
    # rank's own stale gradients: the epoch's end averages again (finished() checks identical weights).
    fast, slow = finished("swa_batchnorm", tmp_path, tmp_path_factory)
    assert len(fast["seen_per_epoch"]) == 4  # 3 epochs and SWA's BatchNorm epoch
    for epoch in range(3):
        assert fast["seen_per_epoch"][epoch] + slow["seen_per_epoch"][epoch] == 512


def test_a_dict_of_training_loaders_trains_the_longest_ones_every_sample_once_per_epoch(tmp_path_factory):
    # Lightning's max_size_cycle: "a" (128 samples, 16 batches) leads, "b" (8 batches) cycles; the step trains "a".
    # The modes and loaders in detail: test_loader_shapes_multiprocess.py.
    fast, slow = _batched("two_loaders", tmp_path_factory)
    assert "error" not in fast and "error" not in slow, (fast.get("error"), slow.get("error"))
    assert fast["seen"] + slow["seen"] == 2 * 128 and fast["global_step"] == slow["global_step"] > 0
