"""The real-data benchmark's pieces: scikit-learn's digits split, the CNN, and the per-seed summary."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn.datasets")
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.digits import summarize, table  # noqa: E402
from benchmarks.task import digits_cnn, load_digits_split  # noqa: E402


def test_the_split_is_fixed_disjoint_stratified_and_scaled():
    train, test = load_digits_split()
    assert len(train) + len(test) == 1797 and 355 <= len(test) <= 365
    again_train, again_test = load_digits_split()
    assert torch.equal(test.tensors[0], again_test.tensors[0]), "the same split every time"
    counts = torch.bincount(test.tensors[1], minlength=10)
    assert counts.min() >= 34 and counts.max() <= 38, counts  # every class about a fifth of its images
    train_rows = {tuple(x.flatten().tolist()) for x in train.tensors[0]}
    overlap = sum(tuple(x.flatten().tolist()) in train_rows for x in test.tensors[0])
    assert overlap <= 3, "test images are held out (a handful of digits are pixel-identical duplicates)"
    for x, _ in (train.tensors, test.tensors):
        assert x.shape[1:] == (1, 8, 8) and x.min() >= 0.0 and x.max() <= 1.0


def test_the_cnn_maps_a_batch_of_digits_to_ten_logits_and_has_no_buffers():
    net = digits_cnn()
    x = load_digits_split()[1].tensors[0][:5]
    assert net(x).shape == (5, 10)
    assert not list(net.buffers())


def _run(acc: float, curve: list[tuple[float, float, float]], wall: float) -> dict:
    return {"val_acc": acc, "val_loss": curve[-1][1], "curve": curve, "train_wall_s": wall, "samples_per_s": 1e3 / wall}


def test_the_summary_gives_mean_and_spread_over_seeds_and_who_reached_the_target():
    runs = {
        "ddp": [_run(0.97, [(5.0, 0.2, 0.95), (10.0, 0.1, 0.97)], 10.0), _run(0.95, [(10.0, 0.1, 0.95)], 10.0)],
        "oscars": [_run(0.96, [(2.0, 0.2, 0.96)], 4.0), _run(0.90, [(4.0, 0.3, 0.90)], 4.0)],
    }
    summary = summarize(runs)
    assert summary["target_acc"] == pytest.approx(0.95)
    ddp, oscars = summary["configs"]["ddp"], summary["configs"]["oscars"]
    assert ddp["final_acc_mean"] == pytest.approx(0.96) and ddp["final_acc_sd"] == pytest.approx(0.0141421, rel=1e-4)
    assert ddp["time_to_target_mean_s"] == pytest.approx(7.5) and ddp["reached_target"] == 2
    assert ddp["time_to_target_median_s"] == pytest.approx(7.5)
    # One seed of two never reached the target: no mean over the survivor, no median, no ratio; reached 1/2.
    assert oscars["reached_target"] == 1 and oscars["time_to_target_mean_s"] is None
    assert oscars["time_to_target_median_s"] is None and "time_to_target_vs_ddp" not in oscars
    assert oscars["throughput_vs_ddp"] == pytest.approx(2.5)
    rows = table("1x/3x", summary)
    assert any(row.startswith("| oscars | 0.9300 ± 0.0424 | - | - | 1/2 |") for row in rows), rows
    # Three seeds, two reached: the median is finite and the ratio uses the medians.
    runs["oscars"].append(_run(0.97, [(3.0, 0.2, 0.97)], 4.0))
    oscars = summarize(runs)["configs"]["oscars"]
    assert oscars["time_to_target_median_s"] == pytest.approx(3.0) and oscars["time_to_target_mean_s"] is None
    assert oscars["time_to_target_vs_ddp"] == pytest.approx(7.5 / 3.0)


def test_the_text_task_summary_targets_a_loss():
    # Final losses 1.60 and 1.64: the target is their mean plus 0.02 nats per byte, reached at the first point below.
    runs = {
        "ddp": [_run(0.5, [(5.0, 1.8, 0.4), (9.0, 1.60, 0.5)], 10.0), _run(0.5, [(8.0, 1.64, 0.5)], 10.0)],
        "oscars": [_run(0.5, [(2.0, 1.7, 0.4), (3.0, 1.63, 0.5)], 5.0), _run(0.5, [(4.0, 1.61, 0.5)], 5.0)],
    }
    summary = summarize(runs, "loss")
    assert summary["target_loss"] == pytest.approx(1.64) and "target_acc" not in summary
    ddp, oscars = summary["configs"]["ddp"], summary["configs"]["oscars"]
    assert ddp["final_loss_mean"] == pytest.approx(1.62) and ddp["time_to_target_median_s"] == pytest.approx(8.5)
    assert oscars["time_to_target_median_s"] == pytest.approx(3.5)
    assert oscars["time_to_target_vs_ddp"] == pytest.approx(8.5 / 3.5)
    assert any(row.startswith("| oscars | 1.6200 ± 0.0141 |") for row in table("1x/3x", summary))


def test_the_text_task_is_pythons_sources_as_next_byte_windows_and_the_model_predicts_every_byte():
    from benchmarks.task import ByteTransformer, load_text_split

    train, test = load_text_split()
    (x, y), (tx, _) = train.tensors, test.tensors
    assert x.shape == (4096, 64) and tx.shape == (512, 64)
    assert torch.equal(x[0, 1:], y[0, :-1]) and torch.equal(y[0, -1:], x[1, :1]), "the target is the next byte"
    logits = ByteTransformer()(x[:3])
    assert logits.shape == (3, 256, 64)
    # Causal: changing a later byte leaves the predictions for the earlier positions as they were.
    changed = x[:1].clone()
    changed[0, 40] = (changed[0, 40] + 1) % 256
    model = ByteTransformer()
    assert torch.allclose(model(x[:1])[..., :40], model(changed)[..., :40], atol=1e-6)
