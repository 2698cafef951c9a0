"""Making the schedule visible: per-round metrics to the user's loggers, the local tau in the progress bar, and a
text summary and a timeline picture at the end of ``fit``.

Everything here reads :attr:`OscarsStrategy.history`, whose records every rank already agreed on in the round's
all-reduce: the monitor adds no collective of its own.
"""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_oscars.core.control import RoundRecord
from lightning_oscars.core.timeline import plot_timeline

__all__ = ["ScheduleMonitor", "round_metrics", "run_fraction_of_ideal", "summarize_history"]

# Beyond this many ranks, per-rank series are summarised as min / median / max to keep loggers usable.
_PER_RANK_LIMIT = 32


def round_metrics(record: RoundRecord, per_rank: bool, prefix: str = "oscars/", unit: str = "rank") -> dict[str, float]:
    """Flatten one round record into logger metrics (pure; unit-tested). ``unit``: what a record's entry is, a
    ``"rank"`` or (with replica groups) a ``"replica"``."""
    metrics = {
        f"{prefix}round": float(record.round),
        f"{prefix}period_s": float(record.period),
        f"{prefix}allreduce_s": float(record.allreduce_time),
        f"{prefix}utilization": float(record.utilization),
        f"{prefix}fraction_of_ideal": float(record.fraction_of_ideal),
        f"{prefix}rebalanced": float(bool(record.rebalanced)),
    }
    series = {
        "tau": record.local_steps,
        "step_time_s": record.step_times,
        "idle_s": record.idle_times,
        "utilization": record.rank_utilization,
    }
    if record.batch_sizes:  # per-rank batch sizes: each rank's own
        series["batch_size"] = record.batch_sizes
    for name, values in series.items():
        if per_rank:
            for rank, value in enumerate(values):
                metrics[f"{prefix}{name}/{unit}{rank}"] = float(value)
        else:
            metrics[f"{prefix}{name}/min"] = float(min(values))
            metrics[f"{prefix}{name}/median"] = float(statistics.median(values))
            metrics[f"{prefix}{name}/max"] = float(max(values))
    return metrics


def run_fraction_of_ideal(history: Sequence[RoundRecord]) -> float:
    """:func:`~lightning_oscars.core.control.fraction_of_ideal` over a whole run: the steps trained over the steps the
    ranks would have trained, at each round's measured speeds, in the training time the records span (from the
    start of training to the last averaging, validation excluded). Lightning's work between steps, no-op slots and
    extra averagings count as lost, as in the benchmarks."""
    steps = ideal = 0.0
    previous = 0.0
    for record in history:
        times = record.step_times
        if all(t > 0.0 for t in times):
            steps += sum(c / t for c, t in zip(record.compute_times, times))
            ideal += (record.time - previous) * sum(1.0 / t for t in times)
        previous = record.time
    return steps / ideal if ideal > 0.0 else 0.0


def summarize_history(history: Sequence[RoundRecord], name: str = "oscars") -> str:
    """A few lines describing what the scheduler did over a run (pure; unit-tested), headed by the strategy's
    ``name``. Its efficiency figure is :func:`run_fraction_of_ideal`, the figure the demo and the benchmarks
    report."""
    if not history:
        return f"{name}: no averaging round ran"
    n = len(history[0].local_steps)
    idle = [sum(r.idle_times[i] for r in history) for i in range(n)]
    allreduce = sum(r.allreduce_time for r in history)
    rebalances = sum(1 for r in history if r.rebalanced)
    last = history[-1]
    per_100 = 100.0 * rebalances / len(history)
    lines = [
        f"{name}: {len(history)} rounds, {rebalances} schedule changes ({per_100:.1f} per 100 rounds),"
        f" {run_fraction_of_ideal(history):.1%} of ideal throughput",
        f"  final tau per rank: {_short(list(last.local_steps))}",
        *([f"  batch size per rank: {_short(list(last.batch_sizes))}"] if last.batch_sizes else []),
        f"  final step time per rank (ms): {_short([round(1e3 * t, 2) for t in last.step_times])}",
        f"  idle per rank (s, total): {_short([round(t, 2) for t in idle])}",
        f"  averaging all-reduce: {allreduce:.2f} s total, {1e3 * allreduce / len(history):.2f} ms per round",
    ]
    return "\n".join(lines)


def _short(values: Sequence[Any], limit: int = 16) -> str:
    if len(values) <= limit:
        return str(list(values))
    return f"{list(values[: limit // 2])} ... {list(values[-limit // 2 :])} ({len(values)} ranks)"


class ScheduleMonitor(Callback):
    """Logs what oscars' scheduler does, through whatever Lightning loggers the trainer has.

    ``OscarsStrategy`` adds one automatically (``monitor=True``); add your own to change its settings.

    Per round (every ``log_every_n_rounds`` rounds), under the ``oscars/`` prefix: ``period_s`` (``T*`` as
    measured: the busiest rank's compute time), ``allreduce_s``, ``utilization`` (cluster), ``rebalanced``, and
    per rank ``tau``, ``step_time_s``, ``idle_s`` and ``utilization`` (as ``.../rank{i}``; summarised as
    ``min``/``median``/``max`` beyond 32 ranks unless ``per_rank`` says otherwise). The progress bar shows
    the local rank's ``tau`` and the last round's cluster utilisation (``util``). At the end of ``fit`` rank 0
    prints a short summary and, with matplotlib installed, draws the schedule (:func:`plot_timeline`): to a
    TensorBoard logger as the figure ``oscars/timeline``, to any other logger with a directory as
    ``oscars_timeline.png`` in it.

    Args:
        log_every_n_rounds: log one round in this many (all rounds by default).
        per_rank: log every rank's series; ``None`` means "if there are at most 32 ranks".
        prog_bar: show ``tau`` and ``util`` in the progress bar.
        summary: print the end-of-fit summary.
        timeline: draw the schedule at the end of ``fit`` (rank 0, to the loggers; nothing without a logger or
            without matplotlib).
        timeline_rounds: draw at most this many rounds (the first ones), so that long fits stay legible.
    """

    def __init__(
        self,
        log_every_n_rounds: int = 1,
        per_rank: bool | None = None,
        prog_bar: bool = True,
        summary: bool = True,
        timeline: bool = True,
        timeline_rounds: int = 60,
    ) -> None:
        if isinstance(log_every_n_rounds, bool) or not isinstance(log_every_n_rounds, int) or log_every_n_rounds < 1:
            raise ValueError(f"log_every_n_rounds must be an integer >= 1, got {log_every_n_rounds!r}")
        self.log_every_n_rounds = log_every_n_rounds
        self.per_rank = per_rank
        self.prog_bar = prog_bar
        self.summary = summary
        self.timeline = timeline
        self.timeline_rounds = timeline_rounds
        self.timeline_paths: list[str] = []  # where the last fit's timeline went (PNG files, TensorBoard runs)
        self._logged = 0  # history records already handled

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._logged = len(_history(trainer))

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        # Only after a round ended: Lightning keeps showing progress-bar values until they are logged again, so
        # the per-step hot path costs one length check.
        if self._flush(trainer) and self.prog_bar and trainer.world_size > 1:
            last = _history(trainer)[-1]
            tau = getattr(trainer.strategy, "local_steps", last.local_steps)[_place(trainer)[0]]
            # logger=False and no sync: a local value shown locally, never a collective.
            pl_module.log("tau", float(tau), prog_bar=True, logger=False, on_step=True, on_epoch=False)
            pl_module.log("util", float(last.utilization), prog_bar=True, logger=False, on_step=True, on_epoch=False)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush(trainer)
        history = _history(trainer)
        if self.summary and trainer.world_size > 1 and history:
            name = getattr(trainer.strategy, "strategy_name", "oscars")
            rank_zero_info(summarize_history(history, name))
        if self.timeline and trainer.world_size > 1 and history and trainer.is_global_zero:
            self._draw_timeline(trainer, history)

    def _draw_timeline(self, trainer: Trainer, history: Sequence[RoundRecord]) -> None:
        if importlib.util.find_spec("matplotlib") is None:
            return
        import matplotlib.pyplot as plt

        title = getattr(trainer.strategy, "strategy_name", "oscars")
        for logger in trainer.loggers:
            figure = None
            try:
                if isinstance(logger, TensorBoardLogger):
                    figure = plot_timeline(history, title=title, max_rounds=self.timeline_rounds)
                    step = trainer.global_step
                    logger.experiment.add_figure("oscars/timeline", figure, global_step=step, close=False)
                    self.timeline_paths.append(str(logger.log_dir))
                elif logger.log_dir is not None:
                    path = Path(logger.log_dir) / "oscars_timeline.png"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    figure = plot_timeline(history, path, title=title, max_rounds=self.timeline_rounds)
                    self.timeline_paths.append(str(path))
            except Exception as error:  # noqa: BLE001 - a picture never fails a finished fit
                rank_zero_warn(f"oscars: could not draw the schedule's timeline: {type(error).__name__}: {error}")
            finally:
                if figure is not None:
                    plt.close(figure)  # only our own: the user's figures stay open

    def _flush(self, trainer: Trainer) -> bool:
        """Log the rounds recorded since the last call; return whether there were any."""
        history = _history(trainer)
        if len(history) <= self._logged:
            return False
        new, self._logged = history[self._logged :], len(history)
        if not trainer.loggers:
            return True
        _, unit = _place(trainer)
        for record in new:
            if record.round % self.log_every_n_rounds:
                continue
            per_rank = self.per_rank if self.per_rank is not None else len(record.local_steps) <= _PER_RANK_LIMIT
            metrics = round_metrics(record, per_rank, unit=unit)
            for logger in trainer.loggers:  # loggers write on global rank 0 only
                logger.log_metrics(metrics, step=record.global_step)
        return True


def _place(trainer: Trainer) -> tuple[int, str]:
    """This rank's entry in the records and what an entry is: its rank, or its replica with replica groups."""
    layout = getattr(trainer.strategy, "layout", None)
    if layout is None or layout.replica_size == 1:
        return trainer.global_rank, "rank"
    return layout.replica_of(trainer.global_rank), "replica"


def _history(trainer: Trainer) -> Sequence[RoundRecord]:
    return getattr(trainer.strategy, "history", ())
