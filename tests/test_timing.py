import math

import pytest

from lightning_oscars.core.timing import StepTimeEstimator, WallClock


def test_median_resists_outliers_and_ema_follows_drift():
    est = StepTimeEstimator(smoothing=0.5)
    for t in [0.1, 0.1, 5.0, 0.1]:
        est.add(t)
    assert est.end_round() == pytest.approx(0.1)
    for _ in range(3):
        for t in [0.3, 0.3, 0.3]:
            est.add(t)
        value = est.end_round()
    assert value == pytest.approx(0.3 - 0.2 / 8)


def test_bad_samples_are_rejected_with_one_warning():
    est = StepTimeEstimator()
    with pytest.warns(RuntimeWarning, match="ignoring a step time of nan") as caught:
        for t in [math.nan, math.inf, -1.0, 0.0]:
            est.add(t)
    assert len(caught) == 1
    assert est.rejected == 4
    assert est.end_round() is None
    with pytest.raises(ValueError, match="smoothing"):
        StepTimeEstimator(0.0)


def test_wall_clock_laps(monkeypatch):
    readings = iter([10.0, 11.0, 11.5, 12.25])  # construction, mark, two laps
    monkeypatch.setattr("lightning_oscars.core.timing.time.perf_counter", lambda: next(readings))
    clock = WallClock()
    clock.mark()
    clock.lap()
    clock.lap()
    assert clock.drain() == [0.5, 0.75]  # each lap from the previous mark or lap, not from construction
    assert clock.drain() == []
