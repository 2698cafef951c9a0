"""Solver cost and quality: the paper's Algorithm 1 vs the exact solver, 2..4,096 ranks with random speeds.

    python -m benchmarks.solver --repeats 7

For every rank count and every speed mix, draws random step times, times each solver (median of
``--repeats`` solves after one warm-up) and prices the schedule it returns: idle fraction (share of the
cluster's round time spent waiting at the barrier), utilisation with the all-reduce cost included, and
throughput (optimizer steps per second summed over ranks). Writes benchmarks/results/solver.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.tables import markdown_table
from lightning_oscars.core.solver import Schedule, solve_schedule, solve_schedule_alg1

# Speed mixes: seconds per step of one rank, drawn per rank.
MIXES: dict[str, Callable[[random.Random], float]] = {
    # every rank somewhere between 1x and 3x slower than the fastest
    "uniform_1_3": lambda rng: 0.1 * rng.uniform(1.0, 3.0),
    # half the ranks a previous GPU generation (0.4x speed), 5% stragglers (0.2x), mild noise
    "generations": lambda rng: 0.1 * rng.choice([1.0] * 55 + [2.5] * 40 + [5.0] * 5) * rng.uniform(0.97, 1.03),
}
RANKS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
# The columns of the markdown table formatted as they are (3 decimals), after the mix and the rank count.
_TABLE_KEYS = (
    "exact_ms",
    "alg1_ms",
    "exact_idle_fraction",
    "best_idle_fraction",
    "alg1_idle_fraction",
    "exact_utilization",
    "best_utilization",
    "alg1_utilization",
)


def _time_solve(solve: Callable[[], Schedule], repeats: int) -> tuple[float, Schedule]:
    schedule = solve()  # warm-up (imports, allocator)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        solve()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), schedule


def _price(schedule: Schedule) -> dict[str, float]:
    idle = sum(schedule.idle_times) / (len(schedule.local_steps) * schedule.period)
    return {
        "idle_fraction": idle,
        "utilization": schedule.utilization,
        "throughput": schedule.throughput,
        "period": schedule.period,
        "max_tau": max(schedule.local_steps),
        "min_tau": min(schedule.local_steps),
    }


def _row(a: argparse.Namespace, mix: str, draw: Callable[[random.Random], float], n: int) -> dict:
    """One mix at ``n`` ranks: both solvers' time per solve and the price of the schedules they return, and of the
    exact solver's best schedule (tolerance 0)."""
    rng = random.Random(f"{a.seed}-{mix}-{n}")
    times = [draw(rng) for _ in range(n)]
    bounds = {"max_spread": a.max_spread, "max_local_steps": a.max_local_steps}
    exact_s, exact = _time_solve(lambda t=times, b=bounds: solve_schedule(t, a.allreduce, **b), a.repeats)
    # tolerance 0: the highest throughput under the bounds (the default trades <= 2% for shorter rounds)
    best = solve_schedule(times, a.allreduce, tolerance=0.0, **bounds)
    # Algorithm 1 ignores the all-reduce; price its schedule with the same cost.
    alg1_s, alg1 = _time_solve(lambda t=times, b=bounds: solve_schedule_alg1(t, **b), a.repeats)
    alg1 = Schedule(alg1.local_steps, alg1.step_times, a.allreduce)
    row = {"mix": mix, "ranks": n, "exact_ms": exact_s * 1e3, "alg1_ms": alg1_s * 1e3}
    row.update({f"exact_{k}": v for k, v in _price(exact).items()})
    row.update({f"best_{k}": v for k, v in _price(best).items()})
    row.update({f"alg1_{k}": v for k, v in _price(alg1).items()})
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allreduce", type=float, default=0.05, help="all-reduce seconds per round (both solvers)")
    p.add_argument("--max-ranks", type=int, default=4096)
    p.add_argument("--max-spread", type=int, default=16, help="M, as the strategy's default")
    p.add_argument("--max-local-steps", type=int, default=16, help="as the strategy's default")
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    rows = []
    for mix, draw in MIXES.items():
        for n in [r for r in RANKS if r <= a.max_ranks]:
            row = _row(a, mix, draw, n)
            rows.append(row)
            print(
                f"{mix:12s} N={n:5d}  exact {row['exact_ms']:8.3f} ms idle {row['exact_idle_fraction']:.3f} "
                f"util {row['exact_utilization']:.3f} | alg1 {row['alg1_ms']:8.3f} ms idle "
                f"{row['alg1_idle_fraction']:.3f} util {row['alg1_utilization']:.3f}",
                flush=True,
            )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "repeats": a.repeats,
        "seed": a.seed,
        "allreduce_s": a.allreduce,
        "max_spread": a.max_spread,
        "max_local_steps": a.max_local_steps,
        "mixes": list(MIXES),
    }
    (out / "solver.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"Solver benchmark (median of {a.repeats} solves; all-reduce {a.allreduce * 1e3:.0f} ms per round; "
        f"M={a.max_spread}, max_local_steps={a.max_local_steps} for both solvers; exact = default tolerance 0.02, "
        "best = exact with tolerance 0; throughput = optimizer steps/s summed over ranks)",
        "",
    ]
    headers = ["mix", "ranks", "exact ms", "alg1 ms", "idle exact", "idle best", "idle alg1", "util exact"]
    headers += ["util best", "util alg1", "thr exact/alg1", "thr best/alg1"]
    cells = [
        [r["mix"], r["ranks"], *(f"{r[k]:.3f}" for k in _TABLE_KEYS)]
        + [f"{r['exact_throughput'] / r['alg1_throughput']:.3f}", f"{r['best_throughput'] / r['alg1_throughput']:.3f}"]
        for r in rows
    ]
    lines += markdown_table(headers, cells, "l" + "r" * 11)
    (out / "solver.md").write_text("\n".join(lines) + "\n")
    _plot(rows, out / "solver.png")
    print("\n".join(lines))


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_idle) = plt.subplots(1, 2, figsize=(11, 4))
    for mix in MIXES:
        sel = [r for r in rows if r["mix"] == mix]
        n = [r["ranks"] for r in sel]
        for solver, style in (("exact", "-o"), ("alg1", "--s")):
            ax_time.plot(n, [r[f"{solver}_ms"] for r in sel], style, label=f"{solver}, {mix}")
            ax_idle.plot(n, [r[f"{solver}_idle_fraction"] for r in sel], style, label=f"{solver}, {mix}")
    for ax in (ax_time, ax_idle):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.grid(True, alpha=0.3)
    ax_time.set_yscale("log")
    ax_time.set_ylabel("time per solve (ms)")
    ax_idle.set_ylabel("idle fraction of the round")
    ax_time.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
