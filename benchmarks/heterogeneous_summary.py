"""The figures of ``benchmarks.heterogeneous``' runs, with one definition for every strategy (see that module's
docstring): a rank's unslowed step time, each run's fraction of ideal and idle time, time to the target accuracy,
and per configuration the medians and the ratios to ddp and to ``local_sgd-matched``.
"""

from __future__ import annotations

import statistics

from lightning_oscars.core.control import fraction_of_ideal

__all__ = ["base_step_time", "cluster_figures", "summarize", "time_to"]


def base_step_time(runs: list[dict]) -> float | None:
    """The unslowed step time of a rank, measured by oscars: the fastest rank's per-step time, median over each
    run's rounds (the profiling round left out), then over the runs."""
    times = []
    for r in runs:
        fastest = [min(h["step_times"]) for h in (r.get("history") or [])[1:] if min(h["step_times"]) > 0]
        if fastest:
            times.append(statistics.median(fastest))
    return statistics.median(times) if times else None


def cluster_figures(run_: dict, base_s: float, batch_size: int = 64) -> dict:
    """Fraction of ideal and idle time of one run, from the ranks' own step accounting."""
    if run_.get("per_sample_ms"):
        return per_sample_figures(run_)
    wall = run_["train_wall_s"]
    busy, times = [], []
    for rank in run_["cluster"]:
        steps = rank["real_steps"]
        # busy = real steps at the measured base time + the emulated extra (k-1) * calibrated device time per step
        busy.append(steps * base_s + (rank["busy_s"] - steps * rank["solo_step_s"]))
        # at the starting factor: the volatile profile swaps two speeds, which leaves sum_i 1/t_i unchanged
        times.append(base_s + (rank["start_factor"] - 1.0) * rank["solo_step_s"])
    history = run_.get("history") or []
    return {
        "idle_s": [max(0.0, wall - b) for b in busy],
        "ideal_samples_per_s": sum(batch_size / t for t in times),
        "fraction_of_ideal": fraction_of_ideal(busy, times, wall),
        "changes_per_100_rounds": 100.0 * run_.get("schedule_changes", 0) / len(history) if history else None,
    }


def per_sample_figures(run_: dict) -> dict:
    """A regime whose step time grows with the batch (``--per-sample-ms``): the ideal is a perfect split of every
    global batch with free communication, ``sum_i B / t_i`` samples per second (``t_i``: rank ``i``'s device time for
    a batch of ``B``; the same figure whether the ranks split the global batch or step on batches of ``B``), and the
    fraction of ideal the samples per second over it. A rank's idle time: the wall less its device time."""
    wall, batch = run_["train_wall_s"], run_["batch_size"]
    times = [rank["start_factor"] * rank["solo_step_s"] for rank in run_["cluster"]]
    ideal = sum(batch / t for t in times)
    return {
        "idle_s": [max(0.0, wall - rank["busy_s"]) for rank in run_["cluster"]],
        "ideal_samples_per_s": ideal,
        "fraction_of_ideal": run_["samples_per_s"] / ideal,
        "changes_per_100_rounds": None,
    }


def time_to(curve: list, target: float) -> float | None:
    return next((t for t, _, acc in curve if acc >= target), None)


def summarize(runs: dict[str, list[dict]]) -> dict:
    base_s = base_step_time([r for name, rs in runs.items() if name.startswith("oscars") for r in rs])
    ddp = runs.get("ddp")
    target = statistics.median(r["val_acc"] for r in ddp) - 0.01 if ddp else None
    summary: dict = {"base_step_s": base_s, "target_acc": target, "configs": {}}
    for name, rs in runs.items():
        figures = base_s is not None or all(r.get("per_sample_ms") for r in rs)
        for r in rs:
            if figures:
                r.update(cluster_figures(r, base_s or 0.0))
            r["time_to_target_s"] = time_to(r["curve"], target) if target is not None else None
        reached = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None]
        s = {
            "median_train_wall_s": statistics.median(r["train_wall_s"] for r in rs),
            "median_samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
            "median_val_acc": statistics.median(r["val_acc"] for r in rs),
            "median_time_to_target_s": statistics.median(reached) if len(reached) == len(rs) else None,
            "walls": [round(r["train_wall_s"], 2) for r in rs],
            "schedule": rs[-1]["schedule"],
            "shares": rs[-1].get("shares"),
            "runs": rs,
        }
        allreduce = [r["allreduce_s"] for r in rs if r.get("allreduce_s")]
        s["median_allreduce_ms"] = 1e3 * statistics.median(allreduce) if allreduce else None
        changes = [r["changes_per_100_rounds"] for r in rs if r.get("changes_per_100_rounds") is not None]
        s["median_changes_per_100_rounds"] = statistics.median(changes) if changes else None
        s["median_rounds"] = statistics.median(r["rounds"] for r in rs)
        if figures:
            s["median_fraction_of_ideal"] = statistics.median(r["fraction_of_ideal"] for r in rs)
            s["median_idle_s"] = [statistics.median(r["idle_s"][i] for r in rs) for i in range(len(rs[0]["idle_s"]))]
        summary["configs"][name] = s
    base = summary["configs"].get("ddp")
    matched = summary["configs"].get("local_sgd-matched")
    for s in summary["configs"].values():
        s["throughput_vs_local_sgd_matched"] = (
            s["median_samples_per_s"] / matched["median_samples_per_s"] if matched else None
        )
        s["throughput_vs_ddp"] = s["median_samples_per_s"] / base["median_samples_per_s"] if base else None
        t_ddp = base.get("median_time_to_target_s") if base else None
        t = s["median_time_to_target_s"]
        s["time_to_target_speedup"] = t_ddp / t if t_ddp and t else None
        s["acc_delta_pts"] = 100 * (s["median_val_acc"] - base["median_val_acc"]) if base else None
    return summary
