"""The schedule as a picture: a fit's round history drawn as one lane per rank (:func:`plot_timeline`).

Each round spans from the previous averaging to its own (``RoundRecord.time``; the first round from
``time - wall``). On a rank's lane it is drawn as that rank's real steps (its compute time), then its wait for the
busiest rank (waiting and no-op slots), then the round's averaging and the work at its edges, which every rank
shares. Beneath, the cluster's utilisation per round: compute over what the ranks could have computed in the
round's span. Pure: matplotlib is imported when a figure is drawn (``pip install matplotlib``), nothing else.

Command (installed with the package): ``oscars-timeline HISTORY.json OUT.png``, where the JSON is a list of round
records (``[r.as_dict() for r in strategy.history]``), an object with a ``"history"`` list, or a benchmark's
results (``--select 1x/3x --select oscars-exact-uniform`` picks the run).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RoundSpan", "load_history", "plot_timeline", "round_spans"]

_COLORS = {"steps": "#2a9d8f", "wait": "#e9c46a", "average": "#264653", "rebalanced": "#e76f51"}


@dataclass(frozen=True)
class RoundSpan:
    """Where one round lies on the timeline, in seconds since training started (validation left out)."""

    round: int
    start: float
    end: float
    compute: tuple[float, ...]  # per rank: its real steps' seconds
    steps: tuple[int, ...]  # per rank: the local steps in force
    rebalanced: bool
    batch_sizes: tuple[int, ...] = ()  # per rank: its own batch size (per-rank batch sizes); empty: one for all

    @property
    def busiest(self) -> float:
        return max(self.compute, default=0.0)

    @property
    def utilization(self) -> float:
        """Compute over what every rank could have computed in the round's span."""
        span = self.end - self.start
        return sum(self.compute) / (len(self.compute) * span) if span > 0 and self.compute else 0.0


def round_spans(history: Sequence[Mapping[str, Any]]) -> list[RoundSpan]:
    """The rounds of ``history`` (``RoundRecord`` objects or their dicts) laid end to end."""
    spans: list[RoundSpan] = []
    previous: float | None = None
    for record in history:
        compute = tuple(float(c) for c in record["compute_times"])
        end = float(record["time"])
        busiest = max(compute, default=0.0)
        cost = max(float(record.get("allreduce_time", 0.0)), float(record.get("round_cost", 0.0)))
        start = end - (busiest + cost) if previous is None else previous
        # A round never starts before its busiest rank could have begun (clock skew, excluded validation time).
        start = min(start, end - busiest)
        steps = tuple(int(s) for s in record["local_steps"])
        sizes = tuple(int(b) for b in record.get("batch_sizes") or ())
        spans.append(RoundSpan(int(record["round"]), start, end, compute, steps, bool(record.get("rebalanced")), sizes))
        previous = end
    return spans


def plot_timeline(
    history: Sequence[Mapping[str, Any]],
    path: str | Path | None = None,
    *,
    title: str | None = None,
    max_rounds: int | None = None,
) -> Any:
    """Draw ``history`` (a fit's round records, e.g. ``trainer.strategy.history``) as a timeline figure.

    One lane per rank: real steps, waiting for the busiest rank (and no-op slots), the round's averaging; the
    cluster's utilisation per round beneath; a rebalanced schedule is marked on the time axis. ``max_rounds``: only
    the first that many rounds (long fits stay legible). Writes a PNG to ``path`` if given; returns the matplotlib
    figure (close it when done). Raises ``ValueError`` for an empty history.
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")  # writing a file needs no display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = round_spans(history)[:max_rounds]
    if not spans:
        raise ValueError("no rounds to draw: the history is empty (was the fit distributed?)")
    ranks = len(spans[0].compute)
    fig, (lanes, util) = plt.subplots(
        2, 1, sharex=True, figsize=(10, 1.2 + 0.45 * ranks + 1.6), gridspec_kw={"height_ratios": [max(ranks, 2), 2]}
    )
    _draw_lanes(lanes, spans, ranks)
    legend: list[Any] = [
        Patch(color=_COLORS["steps"], label="real steps (local steps in force)"),
        Patch(color=_COLORS["wait"], label="waiting for the busiest rank / no-op slots"),
        Patch(color=_COLORS["average"], label="averaging and round edges"),
    ]
    if any(s.rebalanced for s in spans):
        legend.append(plt.Line2D([], [], color=_COLORS["rebalanced"], linestyle="--", label="schedule rebalanced"))
    lanes.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8)
    xs = [x for s in spans for x in (s.start, s.end)]
    ys = [s.utilization for s in spans for _ in (0, 1)]
    util.plot(xs, ys, color=_COLORS["steps"])
    util.fill_between(xs, ys, color=_COLORS["steps"], alpha=0.25)
    util.set_ylim(0, 1.05)
    util.set_ylabel("utilisation")
    util.set_xlabel("training time (s, validation left out)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def _draw_lanes(lanes: Any, spans: Sequence[RoundSpan], ranks: int) -> None:
    """One lane per rank (rank 0 on top): its steps, its wait, the round's averaging; step counts where legible."""
    legible = 0.025 * (spans[-1].end - spans[0].start)
    for span in spans:
        for rank, compute in enumerate(span.compute):
            y = (ranks - 1 - rank - 0.4, 0.8)
            lanes.broken_barh([(span.start, compute)], y, color=_COLORS["steps"])
            if span.busiest > compute:
                lanes.broken_barh([(span.start + compute, span.busiest - compute)], y, color=_COLORS["wait"])
            edges = (span.start + span.busiest, span.end - span.start - span.busiest)
            lanes.broken_barh([edges], y, color=_COLORS["average"])
            if rank < len(span.steps) and compute > legible:
                label = str(span.steps[rank])
                lanes.text(span.start + compute / 2, ranks - 1 - rank, label, ha="center", va="center", fontsize=7)
        if span.rebalanced:
            lanes.axvline(span.end, color=_COLORS["rebalanced"], linewidth=1.0, linestyle="--")
    sizes = spans[-1].batch_sizes
    names = [f"rank {r}" + (f"\nbatch {sizes[r]}" if len(sizes) == ranks else "") for r in range(ranks)]
    lanes.set_yticks(range(ranks), names[::-1])
    lanes.set_ylim(-0.6, ranks - 0.4)


def load_history(path: str | Path, select: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The round records in the JSON at ``path``: a list of records, an object with a ``"history"`` list, or any
    nesting of those (a benchmark's results: the first run whose keys on the way include every one of ``select``,
    e.g. ``("1x/3x", "oscars-exact-uniform")``)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, list) and all(isinstance(r, dict) and "compute_times" in r for r in data):
        return data
    found = _find_history(data, (), tuple(select))
    if found is None:
        raise ValueError(f"{path}: no round history found" + (f" under {list(select)}" if select else ""))
    return found


def _find_history(data: Any, keys: tuple[str, ...], select: tuple[str, ...]) -> list[dict[str, Any]] | None:
    if isinstance(data, dict):
        history = data.get("history")
        if isinstance(history, list) and history and all(s in keys for s in select):
            return history
        items: Any = data.items()
    elif isinstance(data, list):
        items = ((str(i), v) for i, v in enumerate(data))
    else:
        return None
    for key, value in items:
        found = _find_history(value, (*keys, str(key)), select)
        if found is not None:
            return found
    return None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Draw a fit's round history as a timeline (PNG).")
    parser.add_argument("history", type=Path, help="JSON: a list of round records, or an object with 'history'")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--select", action="append", default=[], help="a key on the way to the run (profile, config)")
    parser.add_argument("--max-rounds", type=int, default=None)
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    figure = plot_timeline(
        load_history(args.history, args.select), args.out, title=args.title, max_rounds=args.max_rounds
    )
    import matplotlib.pyplot as plt

    plt.close(figure)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
