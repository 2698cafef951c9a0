"""Heterogeneous speed-up, side by side: ddp, fixed-period local SGD and oscars (each solver and averaging
mode) on 2 CPU ranks, for several slowdown profiles, several repeats, medians and ratios from one invocation.

    python -m benchmarks.heterogeneous --repeats 3 --epochs 4
    python -m benchmarks.heterogeneous --profiles 1x/3x --configs ddp,oscars-exact-uniform --repeats 1

Definitions (the same for every strategy; see benchmarks/README.md):
* train wall: from the end of each rank's start-up calibration to the end of training (slowest rank), time
  spent in validation excluded (the same validation runs under every strategy).
* step time of a rank ``t_i``: seconds per real optimizer step when it does not wait for anybody, as oscars
  measures it (median over the oscars runs of the profile); an emulated ``k``x rank adds ``(k-1)`` times its
  calibrated compute time. ``ideal`` = sum of the ranks' solo throughputs ``batch / t_i``.
* utilisation = sum_i (real steps_i x t_i) / (ranks x train wall); idle_i = train wall - real steps_i x t_i.
* time to target: first validation (4 per epoch) whose accuracy reaches the target, which is ddp's median
  final accuracy minus 1 point.
Writes benchmarks/results/heterogeneous.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.tables import markdown_table

CONFIGS = {
    "ddp": ["--strategy", "ddp"],
    "local_sgd": ["--strategy", "local_sgd"],
    "oscars-exact-uniform": ["--strategy", "oscars", "--solver", "exact", "--averaging", "uniform"],
    "oscars-exact-samples": ["--strategy", "oscars", "--solver", "exact", "--averaging", "samples"],
    "oscars-alg1-uniform": ["--strategy", "oscars", "--solver", "alg1", "--averaging", "uniform"],
    "oscars-alg1-samples": ["--strategy", "oscars", "--solver", "alg1", "--averaging", "samples"],
}
PROFILES = {
    "homogeneous": "",
    "1x/2x": "1:2",
    "1x/3x": "1:3",
    "1x/5x": "1:5",
    # rank 1 starts 3x slower; after 3 s the ranks swap speeds
    "volatile": "1:3@0,1@3;0:1@0,3@3",
}


def run(args: list[str], epochs: int, slowdown: str, show: bool = False) -> dict:
    """One 2-rank training run in a fresh process group; returns rank 0's JSON summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "benchmarks.train_job", *args, "--epochs", str(epochs), "--out", str(out)]
        cmd += ["--slowdown", slowdown] + (["--progress"] if show else [])
        leaked = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")
        env = {k: v for k, v in os.environ.items() if k not in leaked}
        env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        sink = None if show else subprocess.DEVNULL
        subprocess.run(cmd, check=True, timeout=900, env=env, stdout=sink, stderr=sink)
        return json.loads(out.read_text())


def base_step_time(runs: list[dict]) -> float | None:
    """The unslowed step time of a rank, measured by oscars: the fastest rank's per-step time."""
    times = [min(r["step_time_s"]) for r in runs if r.get("step_time_s")]
    return statistics.median(times) if times else None


def cluster_figures(run_: dict, base_s: float, batch_size: int = 64) -> dict:
    """Utilisation, idle time and fraction of ideal of one run, from the ranks' own step accounting."""
    wall = run_["train_wall_s"]
    busy, rates = [], []
    for rank in run_["cluster"]:
        steps = rank["real_steps"]
        # busy = real steps at the measured base time + the emulated extra (k-1) * calibrated compute per step
        busy.append(steps * base_s + (rank["busy_s"] - steps * rank["solo_step_s"]))
        rates.append(batch_size / (base_s + (rank["start_factor"] - 1.0) * rank["solo_step_s"]))
    n = len(busy)
    throughput = run_["samples"] / wall
    return {
        "utilization": sum(busy) / (n * wall),
        "idle_s": [max(0.0, wall - b) for b in busy],
        "ideal_samples_per_s": sum(rates),
        "fraction_of_ideal": throughput / sum(rates),
    }


def time_to(curve: list, target: float) -> float | None:
    return next((t for t, _, acc in curve if acc >= target), None)


def summarize(runs: dict[str, list[dict]]) -> dict:
    base_s = base_step_time([r for name, rs in runs.items() if name.startswith("oscars") for r in rs])
    ddp = runs.get("ddp")
    target = statistics.median(r["val_acc"] for r in ddp) - 0.01 if ddp else None
    summary: dict = {"base_step_s": base_s, "target_acc": target, "configs": {}}
    for name, rs in runs.items():
        for r in rs:
            if base_s is not None:
                r.update(cluster_figures(r, base_s))
            r["time_to_target_s"] = time_to(r["curve"], target) if target is not None else None
        reached = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None]
        s = {
            "median_train_wall_s": statistics.median(r["train_wall_s"] for r in rs),
            "median_samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
            "median_val_acc": statistics.median(r["val_acc"] for r in rs),
            "median_time_to_target_s": statistics.median(reached) if len(reached) == len(rs) else None,
            "walls": [round(r["train_wall_s"], 2) for r in rs],
            "schedule": rs[-1]["schedule"],
            "runs": rs,
        }
        if base_s is not None:
            s["median_utilization"] = statistics.median(r["utilization"] for r in rs)
            s["median_fraction_of_ideal"] = statistics.median(r["fraction_of_ideal"] for r in rs)
            s["median_idle_s"] = [statistics.median(r["idle_s"][i] for r in rs) for i in range(len(rs[0]["idle_s"]))]
        summary["configs"][name] = s
    base = summary["configs"].get("ddp")
    for s in summary["configs"].values():
        s["throughput_vs_ddp"] = s["median_samples_per_s"] / base["median_samples_per_s"] if base else None
        t_ddp = base.get("median_time_to_target_s") if base else None
        t = s["median_time_to_target_s"]
        s["time_to_target_speedup"] = t_ddp / t if t_ddp and t else None
        s["acc_delta_pts"] = 100 * (s["median_val_acc"] - base["median_val_acc"]) if base else None
    return summary


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(profile: str, summary: dict) -> list[str]:
    headers = ["strategy", "train wall s (runs)", "samples/s", "vs ddp", "utilisation", "of ideal", "idle s per rank"]
    headers += ["to target s", "vs ddp", "val acc", "delta pts", "final tau"]
    rows = []
    for name, s in summary["configs"].items():
        idle = "/".join(f"{v:.1f}" for v in s["median_idle_s"]) if "median_idle_s" in s else "-"
        rows.append(
            [
                name,
                f"{s['median_train_wall_s']:.1f} ({', '.join(str(w) for w in s['walls'])})",
                f"{s['median_samples_per_s']:.0f}",
                f"{_f(s['throughput_vs_ddp'], '.2f')}x",
                _f(s.get("median_utilization"), ".2f"),
                _f(s.get("median_fraction_of_ideal"), ".2f"),
                idle,
                _f(s["median_time_to_target_s"], ".1f"),
                f"{_f(s['time_to_target_speedup'], '.2f')}x",
                f"{s['median_val_acc']:.4f}",
                _f(s["acc_delta_pts"], "+.2f"),
                s["schedule"] or "-",
            ]
        )
    return [
        f"### {profile}: slowdown `{PROFILES.get(profile, profile)}`, "
        f"target accuracy {_f(summary['target_acc'], '.4f')}",
        "",
        *markdown_table(headers, rows, "llrrrrlrrrrl"),
    ]


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (profile, summary) in zip(axes[0], results.items()):
        for name, s in summary["configs"].items():
            curve = s["runs"][0]["curve"]
            ax.plot([c[0] for c in curve], [c[1] for c in curve], marker=".", label=name)
        ax.set_title(f"{profile} ({PROFILES.get(profile, profile) or 'equal speeds'})")
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel("validation loss")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--profiles", default="1x/2x,1x/3x,1x/5x,volatile,homogeneous")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="heterogeneous")
    a = p.parse_args()
    names = a.configs.split(",")
    results: dict[str, dict] = {}
    for profile in a.profiles.split(","):
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for i in range(a.repeats):
            for name in names:  # interleaved, so drifts of the machine hit every configuration alike
                r = run(CONFIGS[name], a.epochs, PROFILES[profile])
                runs[name].append(r)
                print(
                    f"{profile:12s} [{i + 1}/{a.repeats}] {name:22s} train {r['train_wall_s']:5.1f}s "
                    f"{r['samples_per_s']:6.0f} samples/s  val_acc {r['val_acc']:.4f}  tau {r['schedule']}",
                    flush=True,
                )
        results[profile] = summarize(runs)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"repeats": a.repeats, "epochs": a.epochs, "ranks": 2, "profiles": {k: PROFILES[k] for k in results}}
    (out / f"{a.name}.json").write_text(json.dumps({"meta": meta, "profiles": results}, indent=1))
    lines = [f"{a.epochs} epochs of 16,384 samples, 2 CPU ranks, {a.repeats} repeats (medians), interleaved.", ""]
    for profile, summary in results.items():
        lines += table(profile, summary) + [""]
    (out / f"{a.name}.md").write_text("\n".join(lines))
    plot(results, out / f"{a.name}.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
