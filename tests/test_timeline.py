"""The schedule as a picture: ``plot_timeline`` from a synthetic history whose every pixel is known, and from the
real round histories of a benchmark run (committed results) and of a 2-rank fit (the monitor writes it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402

from lightning_oscars import plot_timeline  # noqa: E402
from lightning_oscars.core.control import RoundRecord  # noqa: E402
from lightning_oscars.core.timeline import _COLORS, load_history, main, round_spans  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def _record(round_: int, time: float, compute: tuple[float, ...], steps: tuple[int, ...], **kw) -> RoundRecord:
    return RoundRecord(
        round=round_,
        time=time,
        epoch=0,
        global_step=round_ * max(steps),
        local_steps=steps,
        step_times=tuple(c / s for c, s in zip(compute, steps)),
        samples=tuple(4 * s for s in steps),
        compute_times=compute,
        allreduce_time=kw.get("allreduce", 0.1),
        rebalanced=kw.get("rebalanced", False),
    )


HISTORY = [
    _record(1, 1.0, (0.6, 0.3), (4, 2)),  # from 1.0 - 0.6 - 0.1 = 0.3: rank 1 waits from 0.6 to 0.9
    _record(2, 2.0, (0.8, 0.8), (8, 4), rebalanced=True),  # from 1.0: nobody waits, averaging from 1.8 to 2.0
]


def _color_at(fig, axes, x: float, y: float) -> tuple[float, float, float]:
    """The figure's colour at data point ``(x, y)`` of ``axes``."""
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3] / 255.0
    px, py = axes.transData.transform((x, y))
    return tuple(image[image.shape[0] - int(round(py)), int(round(px))])


def _near(color: tuple[float, float, float], name: str) -> bool:
    return bool(np.allclose(color, to_rgb(_COLORS[name]), atol=0.03))


def test_rounds_lie_end_to_end_from_the_records():
    spans = round_spans(HISTORY)
    assert [(s.start, s.end) for s in spans] == [(pytest.approx(0.3), 1.0), (1.0, 2.0)]
    assert spans[0].utilization == pytest.approx((0.6 + 0.3) / (2 * 0.7))
    assert spans[1].utilization == pytest.approx(0.8) and spans[1].rebalanced
    # The dicts a benchmark writes give the same spans as the records.
    assert round_spans([dict(r.as_dict()) for r in HISTORY]) == spans


def test_every_rank_lane_shows_its_steps_its_wait_and_the_averaging():
    fig = plot_timeline(HISTORY)
    lanes, util = fig.axes
    try:
        rank0, rank1 = 1.0, 0.0  # rank 0 on top
        assert _near(_color_at(fig, lanes, 0.5, rank0), "steps")
        assert _near(_color_at(fig, lanes, 0.95, rank0), "average")
        assert _near(_color_at(fig, lanes, 0.34, rank1), "steps")  # off its label
        assert _near(_color_at(fig, lanes, 0.75, rank1), "wait"), "rank 1 waits for rank 0"
        assert _near(_color_at(fig, lanes, 0.95, rank1), "average")
        assert _near(_color_at(fig, lanes, 1.5, rank1), "steps"), "round 2: nobody waits"
        assert [t.get_text() for t in lanes.get_yticklabels()] == ["rank 1", "rank 0"]
        assert {t.get_text() for t in lanes.texts} >= {"4", "2", "8"}, "the local steps are written on the lanes"
        rebalanced = [line for line in lanes.get_lines() if line.get_linestyle() == "--"]
        assert [line.get_xdata()[0] for line in rebalanced] == [2.0]
        ys = util.get_lines()[0].get_ydata()
        assert list(ys) == pytest.approx([0.9 / 1.4, 0.9 / 1.4, 0.8, 0.8])
    finally:
        plt.close(fig)


def test_an_empty_history_is_a_clear_error():
    with pytest.raises(ValueError, match="no rounds to draw"):
        plot_timeline([])


def test_the_command_draws_a_benchmark_run_picked_by_its_keys(tmp_path, capsys):
    results = RESULTS / "paradigms_4ranks.json"
    history = load_history(results, ["4r-one-5x", "oscars-exact-uniform"])
    spans = round_spans(history)
    assert len(spans) == len(history) and len(spans[0].compute) == 4
    assert all(a.end == b.start for a, b in zip(spans, spans[1:])), "rounds follow each other"
    assert all(0.0 < s.utilization <= 1.0 for s in spans)
    out = tmp_path / "timeline.png"
    main([str(results), str(out), "--select", "4r-one-5x", "--select", "oscars-exact-uniform"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "wrote" in capsys.readouterr().out
    image = plt.imread(out)
    assert image.shape[0] > 300 and image.shape[1] > 800
    with pytest.raises(ValueError, match="no round history found"):
        load_history(results, ["no-such-profile"])


def test_per_rank_batch_sizes_label_the_lanes():
    sized = [dataclasses.replace(r, batch_sizes=(64, 32)) for r in HISTORY]
    assert round_spans([r.as_dict() for r in sized])[0].batch_sizes == (64, 32)
    fig = plot_timeline(sized)
    try:
        assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["rank 1\nbatch 32", "rank 0\nbatch 64"]
    finally:
        plt.close(fig)
