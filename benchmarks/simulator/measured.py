"""What the measured runs of ``benchmarks.heterogeneous`` give: readers of its results JSON and fits of the
machine's costs (no-op slot, per-averaging overhead, start-up transient, epoch turnover, load) from the
strategy's round histories."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from benchmarks.task import parse_profile

__all__ = [
    "curve_transient",
    "curve_turnover",
    "first_round_transient",
    "fit_round_costs",
    "parse_slowdown",
    "round_residuals",
    "run_allreduce",
    "run_load",
    "run_step_times",
]


def parse_slowdown(spec: str | Mapping[Any, Any], n: int, at_s: float = math.inf) -> tuple[float, ...]:
    """Per-rank emulated factors in force at ``at_s`` seconds (default: the last ones): ``"1:3"`` -> ``(1.0, 3.0)``."""
    factors = [1.0] * n
    if isinstance(spec, Mapping):
        for rank, factor in spec.items():
            factors[int(rank)] = float(factor)
        return tuple(factors)
    for rank, entries in parse_profile(spec).items():
        for start, factor in entries:
            if start <= at_s:
                factors[rank] = factor
    return tuple(factors)


def profile_spec(results: Mapping[str, Any], profile: str) -> str:
    """The slowdown string of ``profile``: the results' ``meta``, else ``benchmarks.heterogeneous.PROFILES``."""
    meta = results.get("meta") if isinstance(results.get("meta"), Mapping) else {}
    specs = meta.get("profiles") if isinstance(meta.get("profiles"), Mapping) else {}
    if isinstance(specs.get(profile), str):
        return specs[profile]
    try:
        from benchmarks.heterogeneous import PROFILES
    except ImportError:  # pragma: no cover - run from outside the repository
        PROFILES = {}
    if profile in PROFILES:
        return PROFILES[profile]
    raise ValueError(f"profile {profile!r}: no slowdown string in the results' meta nor in benchmarks.heterogeneous")


def is_time_varying(spec: str) -> bool:
    return any(len(entries) > 1 or entries[0][0] > 0 for entries in parse_profile(spec).values())


def runs_of(config: Any) -> list[Mapping[str, Any]]:
    if not isinstance(config, Mapping) or not isinstance(config.get("runs"), list):
        return []
    return [r for r in config["runs"] if isinstance(r, Mapping)]


def history_of(run: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    history = run.get("history")
    return [r for r in history if isinstance(r, Mapping)] if isinstance(history, list) else []


def curve_of(run: Mapping[str, Any]) -> list[float]:
    """Training seconds (validation excluded) at every validation; [] if absent or malformed."""
    curve = run.get("curve")
    try:
        return [float(point[0]) for point in curve] if isinstance(curve, list) else []
    except (TypeError, ValueError, IndexError):
        return []


def as_number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def elementwise_median(rows: Sequence[Sequence[float] | None]) -> tuple[float, ...] | None:
    rows = [r for r in rows if r]
    if not rows or len({len(r) for r in rows}) != 1:
        return None
    return tuple(float(statistics.median(col)) for col in zip(*rows))


def run_step_times(run: Mapping[str, Any], batch_size: int) -> list[float] | None:
    """Per-rank mean seconds per real step of one local SGD / oscars run.

    From the round history: compute time over real steps, the first round (profiling, start-up transient) left
    out. Without a history: the run's last smoothed step times (``step_time_s``).
    """
    rounds = history_of(run)[1:]
    try:
        compute = np.sum([r["compute_times"] for r in rounds], axis=0, dtype=float)
        steps = np.sum([r["samples"] for r in rounds], axis=0, dtype=float) / batch_size
        if rounds and compute.ndim == 1 and np.all(steps > 0) and np.all(compute > 0):
            return [float(x) for x in compute / steps]
    except (KeyError, TypeError, ValueError):
        pass
    times = run.get("step_time_s")
    if isinstance(times, list) and times and all((as_number(t) or 0.0) > 0 for t in times):
        return [float(t) for t in times]
    return None


def run_allreduce(run: Mapping[str, Any]) -> float | None:
    """Median averaging cost of one run (the history's per-round ``allreduce_time``), else its last one."""
    costs = [as_number(r.get("allreduce_time")) for r in history_of(run)[1:]]
    costs = [c for c in costs if c]
    if costs:
        return float(statistics.median(costs))
    cost = as_number(run.get("allreduce_s"))
    return cost if cost else None


def validation_records(history: Sequence[Mapping[str, Any]], validations_per_epoch: int) -> set[int]:
    """Indices of the records right before a validation: their epoch-local ``global_step`` is a multiple of
    Lightning's ``val_check_batch`` (``int(slots of the epoch / validations per epoch)``)."""
    ends: dict[int, int] = {}
    for r in history:
        ends[int(r["epoch"])] = max(ends.get(int(r["epoch"]), 0), int(r["global_step"]))
    out = set()
    for index, r in enumerate(history):
        epoch = int(r["epoch"])
        base = max((g for e, g in ends.items() if e < epoch), default=0)
        check = max(1, int((ends[epoch] - base) / validations_per_epoch))
        if (int(r["global_step"]) - base) % check == 0:
            out.add(index)
    return out


def round_residuals(run: Mapping[str, Any], batch_size: int) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """Per clean round of a history: (wall - all-reduce - busiest compute, compute per rank, no-op slots per rank).

    Left out: rounds across an epoch turnover, and rounds right after a validation (the history's clock runs
    through validation; the benchmark's train wall does not).
    """
    history = history_of(run)
    epochs = {r.get("epoch") for r in history}
    per_epoch = round(len(curve_of(run)) / len(epochs)) if epochs else 0
    try:
        after_validation = {i + 1 for i in validation_records(history, per_epoch)} if per_epoch else set()
    except (KeyError, TypeError, ValueError):
        after_validation = set()
    rows = []
    for index, (a, b) in enumerate(zip(history[:-1], history[1:]), start=1):
        try:
            if a["epoch"] != b["epoch"] or index in after_validation:
                continue
            wall = float(b["time"]) - float(a["time"])
            slots = int(b["global_step"]) - int(a["global_step"])
            compute = np.asarray(b["compute_times"], dtype=float)
            real = np.asarray(b["samples"], dtype=float) / batch_size
            cost = float(b["allreduce_time"])
        except (KeyError, TypeError, ValueError):
            continue
        if slots > 0 and wall > 0 and compute.ndim == 1 and compute.size:
            rows.append((wall - cost - float(compute.max()), compute, np.maximum(slots - real, 0.0)))
    return rows


def fit_round_costs(
    rows: Sequence[tuple[float, np.ndarray, np.ndarray]], max_noop_s: float = 5e-3
) -> tuple[float, float] | None:
    """(no-op slot s, per-averaging overhead s) that best explain the rounds' residuals (least absolute error).

    A round's wall beyond its busiest compute and all-reduce is ``max_i(c_i + noop k_i) - max_i c_i + overhead``
    (``k_i`` no-op slots of rank ``i``). Grid over ``noop`` (0.05 ms steps), the median residual as overhead.
    Equal-speed rounds (no no-ops) pin the overhead; rounds where a rank with no-ops finishes last pin ``noop``.
    """
    rows = [r for r in rows if len(r[1]) == len(rows[0][1])] if rows else []
    if len(rows) < 5:
        return None
    residual = np.array([r[0] for r in rows])
    compute = np.stack([r[1] for r in rows])
    noops = np.stack([r[2] for r in rows])
    best: tuple[float, float, float] | None = None
    for noop in np.arange(0.0, max_noop_s + 1e-12, 5e-5):
        extra = (compute + noop * noops).max(axis=1) - compute.max(axis=1)
        gap = residual - extra
        overhead = float(np.median(gap))
        score = float(np.mean(np.abs(gap - overhead)))
        if best is None or score < best[0] - 1e-12:
            best = (score, float(noop), overhead)
    assert best is not None
    return best[1], max(best[2], 0.0)


def first_round_transient(run: Mapping[str, Any], step_times: Sequence[float] | None, batch_size: int) -> float | None:
    """Extra seconds of the start-up in the first round: ``max_i(compute_i - steps_i x t_i)``."""
    history = history_of(run)
    if not history or not step_times:
        return None
    try:
        compute = np.asarray(history[0]["compute_times"], dtype=float)
        steps = np.asarray(history[0]["samples"], dtype=float) / batch_size
        return float(np.max(compute - steps * np.asarray(step_times)))
    except (KeyError, TypeError, ValueError):
        return None


def curve_transient(run: Mapping[str, Any]) -> float | None:
    """ddp's start-up transient: the first validation's time minus the typical gap between validations."""
    times = curve_of(run)
    if len(times) < 3:
        return None
    return times[0] - float(np.median(np.diff(times)))


def curve_turnover(run: Mapping[str, Any], epochs: int) -> float | None:
    """Epoch turnover of a ddp run: median gap across an epoch end minus median gap within epochs."""
    times = curve_of(run)
    per = len(times) // epochs if epochs else 0
    if per < 2 or len(times) != per * epochs or epochs < 2:
        return None
    gaps = np.diff(times)
    crossing = [g for j, g in enumerate(gaps) if (j + 1) % per == 0]
    within = [g for j, g in enumerate(gaps) if (j + 1) % per != 0]
    return float(np.median(crossing) - np.median(within))


def run_load(run: Mapping[str, Any], batch_size: int, noise: float = 0.0) -> tuple[list[float], float | None] | None:
    """Per-rank load sigma and the load's correlation time (s) of one run, from its rounds' mean step times.

    A round's mean step time ``x = compute / real steps`` varies with the machine's load (and with the per-step
    noise, ``noise^2 / steps`` of the variance, subtracted). The correlation time comes from the lag-1
    autocorrelation ``rho`` of ``log x`` at the median round spacing ``dt``: ``-dt / ln(rho)``.
    """
    rounds = history_of(run)[1:]
    try:
        compute = np.asarray([r["compute_times"] for r in rounds], dtype=float)
        real = np.asarray([r["samples"] for r in rounds], dtype=float) / batch_size
        times = np.asarray([float(r["time"]) for r in rounds])
    except (KeyError, TypeError, ValueError):
        return None
    if compute.ndim != 2 or len(rounds) < 8:
        return None
    sigmas, taus = [], []
    for i in range(compute.shape[1]):
        ok = real[:, i] >= 2
        if ok.sum() < 8:
            return None
        logs = np.log(compute[ok, i] / real[ok, i])
        logs -= logs.mean()
        sigmas.append(math.sqrt(max(0.0, float(logs.var()) - noise * noise / float(np.median(real[ok, i])))))
        rho = float(np.corrcoef(logs[:-1], logs[1:])[0, 1]) if logs.std() > 0 else 0.0
        dt = float(np.median(np.diff(times[ok])))
        if 0.0 < rho < 1.0 and dt > 0:
            taus.append(-dt / math.log(rho))
    return sigmas, (float(statistics.median(taus)) if taus else None)


def results_profiles(results: Mapping[str, Any]) -> Mapping[str, Any]:
    profiles = results.get("profiles")
    if not isinstance(profiles, Mapping):
        raise ValueError(
            "the results JSON has no 'profiles': it predates the {'meta', 'profiles'} format of"
            " benchmarks.heterogeneous; re-run python -m benchmarks.heterogeneous"
        )
    return profiles


def configs_of(summary: Any) -> Mapping[str, Any]:
    configs = summary.get("configs") if isinstance(summary, Mapping) else None
    return configs if isinstance(configs, Mapping) else {}


def all_strategy_runs(results: Mapping[str, Any], profiles: Sequence[str] | None = None) -> list[Mapping[str, Any]]:
    """Every local SGD / oscars run (the strategy's own round history) of the given profiles (default: all)."""
    out = []
    for profile, summary in results_profiles(results).items():
        if profiles is None or profile in profiles:
            for name, config in configs_of(summary).items():
                if name != "ddp":
                    out += runs_of(config)
    return out


def results_setup(results: Mapping[str, Any]) -> dict[str, Any]:
    """Samples, epochs and validations per epoch, read from the runs (benchmarks.train_job's defaults else)."""
    meta = results.get("meta") if isinstance(results.get("meta"), Mapping) else {}
    runs = [r for s in results_profiles(results).values() for c in configs_of(s).values() for r in runs_of(c)]
    samples = [as_number(r.get("samples")) for r in runs]
    samples = [int(s) for s in samples if s]
    epochs = as_number(meta.get("epochs")) or next((as_number(r.get("epochs")) for r in runs if r.get("epochs")), None)
    epochs = int(epochs or 4)
    curves = [len(curve_of(r)) for r in runs if curve_of(r)]
    per_epoch = statistics.median(curves) / epochs if curves else 4
    return {
        "samples": int(statistics.median(samples)) if samples else 65536,
        "epochs": epochs,
        "val_check_interval": 1.0 / per_epoch if per_epoch >= 1 else None,
    }


def constant_profiles(results: Mapping[str, Any]) -> list[str]:
    out = []
    for profile in results_profiles(results):
        try:
            if not is_time_varying(profile_spec(results, profile)):
                out.append(profile)
        except ValueError:
            continue
    return out


def step_time_model(results: Mapping[str, Any], batch: int) -> tuple[float, float] | None:
    """``t(k) = a + b (k - 1)``: step time of a ``k``x rank, least squares over the constant profiles' ranks."""
    ks, ts = [], []
    for profile, summary in results_profiles(results).items():
        try:
            spec = profile_spec(results, profile)
        except ValueError:
            continue
        if is_time_varying(spec):
            continue
        runs = [r for name, c in configs_of(summary).items() if name != "ddp" for r in runs_of(c)]
        times = elementwise_median([run_step_times(r, batch) for r in runs])
        if times:
            ks += list(parse_slowdown(spec, len(times), at_s=0.0))
            ts += list(times)
    if len(set(ks)) < 2:
        return None
    b, a = np.polyfit(np.asarray(ks) - 1.0, np.asarray(ts), 1)
    return float(a), float(b)


def solo_times(runs: Sequence[Mapping[str, Any]]) -> tuple[float, ...] | None:
    """Per-rank median of the runs' calibrated pure-compute step time (``cluster[i]["solo_step_s"]``)."""
    rows = []
    for run in runs:
        cluster = run.get("cluster")
        if isinstance(cluster, list) and cluster and all(isinstance(c, Mapping) for c in cluster):
            solo = [as_number(c.get("solo_step_s")) for c in cluster]
            if all(solo):
                rows.append(solo)
    return elementwise_median(rows)


def regime_step_times(
    runs: Sequence[Mapping[str, Any]],
    batch: int,
    entries: Mapping[int, Sequence[tuple[float, float]]],
    guess: Callable[[float], float],
    n: int,
) -> dict[tuple[int, float], float]:
    """Mean step time of every (rank, emulated factor) of a time-varying profile, from the round histories.

    Each round's mean step time of a rank is assigned to the nearest (in log) of ``guess(k)`` over the factors
    the rank takes in the profile; the rounds of the first averaging (start-up) are left out.
    """
    sums: dict[tuple[int, float], list[float]] = {}
    for run in runs:
        for record in history_of(run)[1:]:
            try:
                compute = [float(x) for x in record["compute_times"]]
                real = [float(x) / batch for x in record["samples"]]
            except (KeyError, TypeError, ValueError):
                continue
            for i in range(min(n, len(compute), len(real))):
                if real[i] < 2 or compute[i] <= 0:
                    continue
                ks = {k for _, k in entries.get(i, [])}
                if not entries.get(i) or min(s for s, _ in entries[i]) > 0:
                    ks.add(1.0)
                x = compute[i] / real[i]
                k = min(ks, key=lambda k: abs(math.log(x / guess(k))))
                acc = sums.setdefault((i, k), [0.0, 0.0])
                acc[0] += compute[i]
                acc[1] += real[i]
    return {key: c / steps for key, (c, steps) in sums.items() if steps > 0}
