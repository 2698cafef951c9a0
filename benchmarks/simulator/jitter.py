"""Per-step jitter at scale: a fixed ``tau`` per round against deadline rounds, in steady state.

    python -m benchmarks.simulator.jitter --out benchmarks/results

With a fixed schedule a round ends when the last of ``N`` ranks finishes its ``tau_i`` steps; with lognormal
per-step jitter of ``sigma`` the sum of ``tau`` steps has a relative spread ``sigma / sqrt(tau)``, and the
maximum over 1,024 ranks sits about 3.2 of those above the mean: the round stretches, every other rank waits.

A *deadline round* fixes the round's length in seconds instead, ``D``: every rank keeps stepping while its next
step is expected to end by ``D``, judged by a quantile ``q`` of its own step time (``elapsed + t_i,q <= D``), and
does no-ops after. The round ends at the latest rank's last step (rarely much past ``D``: a step only starts if
its ``q`` quantile fits), plus the all-reduce. Each rank trains as many steps as fit, so the jitter costs a
fraction of one step per rank, not the slowest rank's tail. ``D`` is chosen, like the exact solver's period,
as the shortest deadline whose simulated throughput is within ``tolerance`` of the best over ``D`` up to
``max_local_steps`` fast steps. Both modes are shown at two caps on a round (16 and 32 fast steps): longer
rounds shrink the relative jitter of the fixed schedule too (``sigma / sqrt(tau)``).

The ``oscars deadline`` column is the strategy's own rule (``deadline_rounds=True``,
``lightning_oscars.core.deadline``): the deadline from ``plan_deadline`` on the ranks' median step times and jitters
(the figures the strategy measures), the 0.9 quantile rule, and steps capped by the strategy's reservations.

Model: steady rounds only (no epochs, no validation, no warm-up: those cost the same in both modes), the
ranks' mean step times known (the strategy's smoothed estimates), the all-reduce a constant. The fixed schedule
is the strategy's own exact solver (``solve_schedule``) on the mean times. Fraction of ideal as everywhere:
steps per second over ``sum_i 1 / t_i``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from benchmarks.simulator.cluster import lognormal
from benchmarks.tables import markdown_table
from lightning_oscars.core.deadline import deadline_steps as oscars_steps
from lightning_oscars.core.deadline import plan_deadline, quantile_step
from lightning_oscars.core.solver import solve_schedule

__all__ = ["deadline_fraction", "fixed_tau_fraction", "jitter_study", "oscars_deadline_fraction", "scale_cluster"]


def scale_cluster(n: int = 1024, base_s: float = 0.1) -> np.ndarray:
    """The issue's scale mix: 47.5% of the ranks at 1x, 47.5% at 0.4x and 5% at 0.2x speed."""
    slow = round(0.05 * n)
    mid = round(0.475 * n)
    speeds = np.array([1.0] * (n - mid - slow) + [0.4] * mid + [0.2] * slow)
    return base_s / speeds


def fixed_tau_fraction(
    times: np.ndarray, tau: np.ndarray, sigma: float, allreduce_s: float, rounds: int, rng: np.random.Generator
) -> float:
    """Steady-state fraction of ideal of a fixed schedule ``tau`` under per-step jitter ``sigma``."""
    width = int(tau.max())
    wall = 0.0
    for _ in range(rounds):
        draws = times[:, None] * lognormal(rng, (len(times), width), sigma)
        busy = np.where(np.arange(width)[None, :] < tau[:, None], draws, 0.0).sum(axis=1)
        wall += busy.max() + allreduce_s
    return rounds * tau.sum() / wall / np.sum(1.0 / times)


def deadline_steps(
    draws: np.ndarray, times: np.ndarray, deadline: float, sigma: float, quantile: float, cap: int
) -> tuple[np.ndarray, np.ndarray]:
    """Steps each rank takes in a deadline round and when its last one ends. ``draws``: ranks x ``cap`` step
    times. A rank takes its next step while ``elapsed + q-quantile of its step <= deadline`` (always the first)."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(quantile)
    q_time = times * np.exp(z * sigma - 0.5 * sigma * sigma)  # the q quantile of a mean-t lognormal step
    ends = np.cumsum(draws, axis=1)
    starts = ends - draws
    allowed = starts + q_time[:, None] <= deadline
    allowed[:, 0] = True
    # steps are taken in order until the first one not allowed
    steps = np.minimum(np.argmin(np.concatenate([allowed, np.zeros((len(times), 1), bool)], axis=1), axis=1), cap)
    finish = ends[np.arange(len(times)), steps - 1]
    return steps, finish


def deadline_fraction(
    times: np.ndarray,
    deadline: float,
    sigma: float,
    allreduce_s: float,
    rounds: int,
    rng: np.random.Generator,
    quantile: float = 0.9,
    cap: int = 64,
) -> float:
    """Steady-state fraction of ideal of deadline rounds of ``deadline`` seconds."""
    steps_total, wall = 0.0, 0.0
    for _ in range(rounds):
        draws = times[:, None] * lognormal(rng, (len(times), cap), sigma)
        steps, finish = deadline_steps(draws, times, deadline, sigma, quantile, cap)
        steps_total += steps.sum()
        wall += finish.max() + allreduce_s
    return steps_total / wall / np.sum(1.0 / times)


def oscars_deadline_fraction(
    times: np.ndarray,
    tau: np.ndarray,
    sigma: float,
    allreduce_s: float,
    max_local_steps: int,
    rounds: int,
    rng: np.random.Generator,
) -> tuple[float, float]:
    """Steady-state fraction of ideal of the strategy's deadline rounds, and the deadline it chose."""
    medians = times * np.exp(-0.5 * sigma * sigma)  # what a rank measures: the median of its mean-t steps
    n = len(times)
    plan = plan_deadline(medians.tolist(), [sigma] * n, tau.tolist(), allreduce_s, max_local_steps)
    deadline = plan.deadline_s
    reserve = np.asarray(plan.reserve)
    width = int(reserve.max())
    quantile_s = torch.tensor([quantile_step(float(t), sigma) for t in medians], dtype=torch.float64)
    steps_total, wall = 0.0, 0.0
    for _ in range(rounds):
        draws = times[:, None] * lognormal(rng, (n, width), sigma)
        draws[np.arange(width)[None, :] >= reserve[:, None]] = np.inf
        taken = oscars_steps(torch.from_numpy(draws), quantile_s, deadline).numpy()
        ends = np.cumsum(np.where(np.isfinite(draws), draws, 0.0), axis=1)
        steps_total += taken.sum()
        wall += ends[np.arange(n), taken - 1].max() + allreduce_s
    return steps_total / wall / np.sum(1.0 / times), deadline


def best_deadline(
    times: np.ndarray, sigma: float, allreduce_s: float, max_local_steps: int, tolerance: float, seed: int
) -> float:
    """The shortest deadline within ``tolerance`` of the best simulated throughput (a few probe rounds each)."""
    fastest = float(times.min())
    grid = [k * fastest for k in range(1, max_local_steps + 1)] + [float(t) * k for t in set(times) for k in (1, 2)]
    grid = sorted({d for d in grid if d <= max_local_steps * fastest})
    scores = [deadline_fraction(times, d, sigma, allreduce_s, 8, np.random.default_rng(seed)) for d in grid]
    best = max(scores)
    return next(d for d, s in zip(grid, scores) if s >= (1.0 - tolerance) * best)


def jitter_study(
    n: int = 1024,
    sigmas: tuple[float, ...] = (0.0, 0.05, 0.1, 0.15),
    caps: tuple[int, ...] = (16, 32),
    base_s: float = 0.1,
    allreduce_steps: float = 0.2,
    rounds: int = 60,
    max_spread: int = 64,
    tolerance: float = 0.01,
    seed: int = 0,
) -> list[dict]:
    """Both modes for every jitter ``sigma`` and every round cap (``max_local_steps``: the fixed schedule's cap on
    any rank's steps, the deadline's cap in fast steps)."""
    times = scale_cluster(n, base_s)
    allreduce_s = allreduce_steps * base_s
    rows = []
    for cap in caps:
        schedule = solve_schedule(
            tuple(times), allreduce_s, max_spread=max_spread, max_local_steps=cap, tolerance=tolerance
        )
        tau = np.asarray(schedule.local_steps)
        for sigma in sigmas:
            fixed = fixed_tau_fraction(times, tau, sigma, allreduce_s, rounds, np.random.default_rng(seed))
            deadline = best_deadline(times, sigma, allreduce_s, cap, tolerance, seed + 1)
            dead = deadline_fraction(times, deadline, sigma, allreduce_s, rounds, np.random.default_rng(seed))
            oscars, oscars_d = oscars_deadline_fraction(
                times, tau, sigma, allreduce_s, cap, rounds, np.random.default_rng(seed)
            )
            rows.append(
                {
                    "ranks": n,
                    "max_local_steps": cap,
                    "sigma": sigma,
                    "fixed_tau": [int(t) for t in sorted(set(tau.tolist()), reverse=True)],
                    "fixed_period_s": schedule.period,
                    "fixed_fraction": fixed,
                    "deadline_s": deadline,
                    "deadline_fraction": dead,
                    "oscars_deadline_s": oscars_d,
                    "oscars_deadline_fraction": oscars,
                }
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    rows = jitter_study(a.ranks, rounds=a.rounds)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "jitter.json").write_text(json.dumps(rows, indent=1))
    table = [
        [
            str(r["ranks"]),
            str(r["max_local_steps"]),
            f"{r['sigma']:.2f}",
            "/".join(map(str, r["fixed_tau"])),
            f"{r['fixed_fraction']:.3f}",
            f"{r['deadline_s']:.2f}",
            f"{r['deadline_fraction']:.3f}",
            f"{r['oscars_deadline_s']:.2f}",
            f"{r['oscars_deadline_fraction']:.3f}",
        ]
        for r in rows
    ]
    headers = ["ranks", "max local steps", "sigma", "fixed tau (1x/0.4x/0.2x)", "fixed: of ideal", "deadline s"]
    headers += ["deadline: of ideal", "oscars deadline s", "oscars deadline: of ideal"]
    lines = [
        f"Steady-state rounds, {a.ranks} ranks (47.5% 1x, 47.5% 0.4x, 5% 0.2x; 1x step 0.1 s), all-reduce 0.2 fast"
        f" steps, lognormal per-step jitter sigma, {a.rounds} rounds, quantile 0.9.",
        "",
        *markdown_table(headers, table, "rrrlrrrrr"),
    ]
    (out / "jitter.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
