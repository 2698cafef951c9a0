"""``balance="batch"``, and per-rank batch sizes under both balances, on 2 ranks through Lightning's launcher (gloo),
rank 1 three times slower in every step (its step time ``(2 ms + 0.2 ms per sample) x 3``, so that its share should
shrink to about a tenth of the global batch). One launch runs every fit in turn (``tests/batch_case.py``): ddp's,
batch-balanced ones, local steps with a batch size per rank, and checkpoints resumed from ddp, from batch balancing and
across balances. Each test reads what the ranks wrote."""

from __future__ import annotations

import json
import sys

import pytest
from subproc import ROOT, assert_clean_exit, clean_env, run

TIMEOUT = 300
BATCH = {"balance": "batch", "warmup_steps": 2}
SIZES = {"warmup_steps": 2, "batch_sizes": [32, 16]}  # local steps, the fast rank on twice the batch
FITS = [
    {"name": "ddp", "strategy": "ddp"},
    {"name": "batch", "strategy": BATCH, "slow": 3},
    {"name": "ddp_accumulated", "strategy": "ddp", "accumulate": 3},
    {"name": "batch_accumulated", "strategy": BATCH, "slow": 3, "accumulate": 3},
    {
        "name": "batchnorm",
        "strategy": BATCH,
        "model": "bn",
        "n": 500,
        "slow": 3,
        "epochs": 3,
        "validate": True,
        "csv": True,
    },
    {"name": "bf16", "strategy": BATCH, "model": "bn", "n": 500, "slow": 3, "precision": "bf16-mixed"},
    {"name": "caps", "strategy": {**BATCH, "batch_sizes": [18, 16]}, "model": "bn", "n": 500, "slow": 3},
    {"name": "ddp_save", "strategy": "ddp", "max_steps": 5, "save_every": 5, "epochs": 1},
    {"name": "batch_from_ddp", "strategy": BATCH, "slow": 3, "epochs": 1, "resume": "ddp_save"},
    {"name": "batch_save", "strategy": BATCH, "slow": 3, "max_steps": 7, "save_every": 7, "epochs": 1},
    {"name": "batch_from_batch", "strategy": BATCH, "slow": 3, "epochs": 1, "resume": "batch_save"},
    {"name": "steps_save", "strategy": {"warmup_steps": 2}, "slow": 3, "max_steps": 6, "save_every": 6},
    {"name": "batch_from_steps_mid_epoch", "strategy": BATCH, "slow": 3, "epochs": 1, "resume": "steps_save"},
    {"name": "steps_epoch", "strategy": {"warmup_steps": 2}, "slow": 3, "epochs": 1, "save_epoch": True},
    {"name": "batch_from_steps", "strategy": BATCH, "slow": 3, "epochs": 2, "resume": "steps_epoch"},
    {"name": "batch_epoch", "strategy": BATCH, "slow": 3, "epochs": 1, "save_epoch": True},
    {"name": "steps_from_batch", "strategy": {"warmup_steps": 2}, "slow": 3, "epochs": 2, "resume": "batch_epoch"},
    {"name": "steps_sizes", "strategy": SIZES, "slow": 3},
    {"name": "ddp_frozen", "strategy": "ddp", "model": "frozen"},
    {"name": "batch_frozen", "strategy": BATCH, "model": "frozen", "slow": 3},
    {"name": "steps_sizes_frozen", "strategy": SIZES, "model": "frozen", "slow": 3},
    {
        "name": "steps_sizes_bn",
        "strategy": {"warmup_steps": 2, "batch_sizes": [24, 16]},
        "model": "bn",
        "n": 500,
        "slow": 3,
        "accumulate": 2,
        "validate": True,
    },
    {"name": "steps_sizes_save", "strategy": SIZES, "slow": 3, "max_steps": 6, "save_every": 6, "epochs": 1},
    {"name": "steps_sizes_resume", "strategy": SIZES, "slow": 3, "epochs": 1, "resume": "steps_sizes_save"},
    # batch_sizes="auto" off CUDA: the DataLoader's batch_size on every rank, under both balances
    {"name": "steps_auto", "strategy": {"warmup_steps": 2, "batch_sizes": "auto"}, "slow": 3, "epochs": 1},
    {"name": "batch_auto", "strategy": {**BATCH, "batch_sizes": "auto"}, "slow": 3, "epochs": 1},
]


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("batch")
    cmd = [sys.executable, str(ROOT / "tests" / "batch_case.py"), json.dumps(FITS), str(out)]
    code, log = run(cmd, TIMEOUT, env=clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT - 20)))
    assert_clean_exit(code, log, TIMEOUT)
    read = lambda name, r: json.loads((out / name / f"rank{r}.json").read_text())  # noqa: E731
    return {fit["name"]: [read(fit["name"], r) for r in (0, 1)] for fit in FITS}


def _largest_difference(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert set(a) == set(b)
    return max(abs(x - y) for key in a for x, y in zip(a[key], b[key]))


def _trained(ranks: list[dict], epoch: int) -> list[float]:
    return sorted(row for rank in ranks for row in rank["trained"].get(str(epoch), []))


def _no_error(*fits: list[dict]) -> None:
    for ranks in fits:
        assert [rank.get("error") for rank in ranks] == [None, None]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("ddp", "batch"), [("ddp", "batch"), ("ddp_accumulated", "batch_accumulated"), ("ddp_frozen", "batch_frozen")]
)
def test_batch_balance_trains_to_ddps_weights_with_unequal_shares(fits, ddp, batch):
    _no_error(fits[ddp], fits[batch])
    fast, slow = fits[batch]
    assert any(s[0] > 2 * s[1] for s in fast["steps"])  # the shares were unequal
    assert fast["global_step"] == fits[ddp][0]["global_step"]  # ddp's optimizer steps
    # Every parameter of the MLP (no BatchNorm, no dropout): ddp's trajectory up to float rounding, on every rank.
    assert _largest_difference(fits[ddp][0]["state"], fast["state"]) < 1e-5
    assert fast["state"] == slow["state"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "name",
    [
        "batch",
        "batch_accumulated",
        "batchnorm",
        "bf16",
        "caps",
        "batch_frozen",
        "steps_sizes",
        "steps_sizes_bn",
        "steps_sizes_frozen",
        "steps_auto",
        "batch_auto",
    ],
)
def test_every_sample_is_trained_once_per_epoch_and_every_rank_ends_identical(fits, name):
    _no_error(fits[name])
    fast, slow = fits[name]
    epochs = sorted(int(e) for e in fast["trained"])
    assert epochs and all(_trained(fits[name], e) == sorted(fast["dataset_rows"]) for e in epochs)
    assert fast["state"] == slow["state"]  # parameters and buffers (BatchNorm's statistics: rank 0's, spread)


@pytest.mark.multiprocess
def test_the_slow_rank_gets_the_balanced_share_of_a_step_that_grows_with_its_batch(fits):
    fast, _ = fits["batchnorm"]
    # Rank 1's step is 3x (2 ms + 0.2 ms/sample): 2 + 0.2 n0 = 6 + 0.6 (32 - n0) balances at n0 = 29.
    last = [step for step in fast["steps"] if sum(step) == 32][-1]  # the last full global batch
    assert 27 <= last[0] <= 30, fast["changes"]
    # It settles: once near the balance, the hysteresis holds the split there against noise (a sample either way).
    shares = [change[2][0] for change in fast["changes"]]
    near = next(i for i, n in enumerate(shares) if 27 <= n <= 30)
    assert all(26 <= n <= 31 for n in shares[near:]) and len(shares) <= 8, fast["changes"]


@pytest.mark.multiprocess
def test_memory_caps_bound_every_share(fits):
    fast, _ = fits["caps"]
    assert fast["caps"] == [18, 16]
    assert all(share <= cap for step in fast["steps"] for share, cap in zip(step, [18, 16]))
    assert max(step[0] for step in fast["steps"]) == 18  # the fast rank is held at its cap


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("first", "second"),
    [("ddp_save", "batch_from_ddp"), ("batch_save", "batch_from_batch"), ("steps_sizes_save", "steps_sizes_resume")],
)
def test_a_mid_epoch_resume_trains_the_rest_of_the_epoch_once(fits, first, second):
    _no_error(fits[first], fits[second])
    before, after = _trained(fits[first], 0), _trained(fits[second], 0)
    assert before and after and sorted(before + after) == sorted(fits[first][0]["dataset_rows"])
    assert fits[second][0]["state"] == fits[second][1]["state"]


@pytest.mark.multiprocess
def test_a_resume_keeps_the_balanced_shares(fits):
    # The checkpoint holds the newest agreed shares, which may not have taken effect by the fit's last step (a change
    # lands a few batches ahead): the resumed fit starts from them.
    saved = fits["batch_save"][0]["changes"][-1][2]
    assert fits["batch_from_batch"][0]["steps"][0] == saved and saved[0] > saved[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("first", "second"), [("steps_epoch", "batch_from_steps"), ("batch_epoch", "steps_from_batch")]
)
def test_a_fit_resumes_across_balances_from_an_epoch_end(fits, first, second):
    _no_error(fits[first], fits[second])
    assert sorted(int(e) for e in fits[second][0]["trained"]) == [1]  # epoch 0 was done: only epoch 1 runs
    assert _trained(fits[second], 1) == sorted(fits[first][0]["dataset_rows"])
    assert fits[second][0]["state"] == fits[second][1]["state"]


@pytest.mark.multiprocess
def test_a_mid_epoch_checkpoint_of_local_steps_is_refused_by_batch_balance_naming_why(fits):
    for rank in fits["batch_from_steps_mid_epoch"]:
        assert "written mid-epoch (batch 6) under balance='steps'" in rank["error"]
        assert rank["trained"] == {}  # refused before any step


@pytest.mark.multiprocess
def test_validation_runs_where_ddps_does_and_every_rank_agrees_on_its_metrics(fits):
    fast, slow = fits["batchnorm"]
    assert fast["validations"] == slow["validations"] == 6  # twice per epoch, 3 epochs
    assert fast["val_loss"] == slow["val_loss"] and fast["val_loss"] == fast["val_loss"]  # agreed, not NaN


@pytest.mark.multiprocess
def test_every_change_of_the_shares_is_logged_to_the_trainers_loggers(fits):
    """Logged when it takes effect: a change agreed at the fit's last steps, due at a batch the fit never reaches,
    is not (which one is the last depends on the timing)."""
    fast, _ = fits["batchnorm"]
    taken = [shares for epoch, batch, shares in fast["changes"] if [epoch, batch] <= fast["last_batch"]]
    assert len(taken) >= 2, "the shares moved at least once from the first ones"
    assert fast["logged_shares"] == [[float(n) for n in shares] for shares in taken]


@pytest.mark.multiprocess
def test_a_fit_keeps_its_shares_run_length_encoded(fits):
    fast, _ = fits["batchnorm"]
    # One entry per split: each change, and each of the 3 epochs' short last batch with the run resuming after it.
    assert len(fast["step_runs"]) <= len(fast["changes"]) + 2 * 3
    assert sum(n for _, n in fast["step_runs"]) == len(fast["steps"]) == fast["global_step"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("name", "sizes"), [("steps_sizes", [32, 16]), ("steps_sizes_bn", [24, 16])])
def test_under_local_steps_each_rank_trains_its_own_batch_size_and_the_fast_rank_more_samples(fits, name, sizes):
    _no_error(fits[name])
    for rank, size in zip(fits[name], sizes):
        lengths = rank["lengths"]
        assert max(lengths) == size
        # Only the epoch's last steps (the units left, or the sample remainder) may hold less than a whole batch: at
        # most a step of 2 micro-batches and the remainder per epoch (2 epochs).
        assert sum(n != size for n in lengths) <= 2 * 3, lengths
    fast, slow = (sum(rank["lengths"]) for rank in fits[name])
    # Rank 0: 2 ms + 0.2 ms x 32 = 8.4 ms per step; rank 1: (2 + 0.2 x 16) x 3 = 15.6 ms: balanced rounds give rank 0
    # about 1.9x the steps of twice the batch (3.7x the samples); equal steps would give it 2x.
    assert fast >= 2.5 * slow, (fast, slow)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["batch_frozen", "steps_sizes_frozen"])
def test_a_frozen_layer_stays_as_initialised_and_a_parameter_no_optimizer_owns_is_never_stepped(fits, name):
    _no_error(fits[name])
    initial = fits["ddp_frozen"][0]  # the same seed: the same initial weights, which ddp also leaves these at
    for rank in fits[name]:
        for key in ("net.0.weight", "net.0.bias", "scale"):
            assert rank["state"][key] == initial["state"][key], key
        assert rank["state"]["net.2.weight"] != initial["state"]["net.2.weight"]  # the rest trained


@pytest.mark.multiprocess
def test_auto_batch_sizes_off_cuda_train_the_dataloaders_batch_size(fits):
    steps, batch = fits["steps_auto"], fits["batch_auto"]
    _no_error(steps, batch)
    for rank in steps:  # local steps: each rank's batches at the DataLoader's 16 (the epoch's last may be shorter)
        assert max(rank["lengths"]) == 16 and sum(n != 16 for n in rank["lengths"]) <= 1, rank["lengths"]
    assert all(sum(step) == 32 for step in batch[0]["steps"][:-1])  # ddp's global batch of 2 x 16, no caps
    assert max(step[0] for step in batch[0]["steps"]) > 16  # and balanced beyond 16 on the fast rank
