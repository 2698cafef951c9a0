"""Convergence on real data: scikit-learn's handwritten digits (1,797 real 8x8 images, shipped with the package).

    python -m benchmarks.digits                       # about 30 minutes on 2 CPU cores
    python -m benchmarks.digits --seeds 2 --profiles 1x/3x --configs ddp,oscars-exact-uniform   # a quick look

A small CNN (``benchmarks.task.digits_cnn``) on a fixed, class-stratified split (1,438 training, 359 test images),
SGD (lr 0.05, momentum 0.9, batch 32), in the GPU-like regime (every step sleeps 30 ms at 1x, as a host waits for its
GPU; a ``k``x rank ``k`` times as long), validated on the test images twice per epoch. Every configuration runs
once per seed (the seed draws the initial weights and the data order), configurations interleaved. Reported per
profile: final test accuracy and the time to a target accuracy (ddp's mean final accuracy minus one point) as mean
and standard deviation over the seeds, throughput as a median, and the test loss against training time (first
seed). Results: ``benchmarks/results/digits.{json,md,png}``.

``--task text``: a small transformer language model (``benchmarks.task.ByteTransformer``, AdamW, lr 0.003, batch 32
windows of 64 bytes) on Python's own standard-library sources (4,096 training windows, 512 held-out ones from later
files); the target is a validation loss, ddp's mean final loss plus 0.02 nats per byte.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from benchmarks.heterogeneous import CONFIGS, PROFILES, plot, run, time_to

DIGITS_ARGS = ["--task", "digits", "--batch-size", "32", "--lr", "0.05", "--val-check-interval", "0.5"]
TASK_ARGS = {"digits": DIGITS_ARGS, "text": ["--task", "text", "--batch-size", "32", "--lr", "0.003"]}
LOSS_MARGIN = 0.02  # the text task's target: ddp's mean final validation loss plus this (nats per byte)
DEFAULT_CONFIGS = "ddp,oscars-exact-uniform,local_sgd,ssp-3"
DEFAULT_PROFILES = "homogeneous,1x/3x,1x/1x/2x/4x"


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _time_to_loss(curve: list, target: float) -> float | None:
    return next((t for t, loss, _ in curve if loss <= target), None)


def summarize(runs: dict[str, list[dict]], metric: str = "acc") -> dict:
    """Per configuration: accuracy (or with ``metric="loss"`` the validation loss) and time to target over the seeds
    (mean, sd), throughput (median)."""
    ddp = runs.get("ddp") or next(iter(runs.values()))
    if metric == "loss":
        target = statistics.mean(r["val_loss"] for r in ddp) + LOSS_MARGIN
        reach = lambda curve: _time_to_loss(curve, target)  # noqa: E731
    else:
        target = statistics.mean(r["val_acc"] for r in ddp) - 0.01
        reach = lambda curve: time_to(curve, target)  # noqa: E731
    configs = {}
    for name, rs in runs.items():
        times = [reach(r["curve"]) for r in rs]
        reached = [t for t in times if t is not None]
        acc_mean, acc_sd = _mean_sd([r["val_acc"] for r in rs])
        loss_mean, loss_sd = _mean_sd([r["val_loss"] for r in rs])
        # Over every seed, never over the survivors: the mean only when every seed reached the target, the median
        # with a seed that never reached it counted as never (None when that is the median).
        tt_mean, tt_sd = _mean_sd(reached) if len(reached) == len(rs) else (None, None)
        median = statistics.median([math.inf if t is None else t for t in times]) if times else math.inf
        configs[name] = {
            "final_acc_mean": acc_mean,
            "final_acc_sd": acc_sd,
            "final_loss_mean": loss_mean,
            "final_loss_sd": loss_sd,
            "time_to_target_mean_s": tt_mean,
            "time_to_target_sd_s": tt_sd,
            "time_to_target_median_s": None if math.isinf(median) else median,
            "reached_target": len(reached),
            "seeds": len(rs),
            "median_train_wall_s": statistics.median(r["train_wall_s"] for r in rs),
            "median_samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
            "runs": rs,
        }
    base = configs.get("ddp")
    for s in configs.values():
        if base and base["median_train_wall_s"]:
            s["throughput_vs_ddp"] = base["median_train_wall_s"] / s["median_train_wall_s"]
        if base and base["time_to_target_median_s"] and s["time_to_target_median_s"]:
            s["time_to_target_vs_ddp"] = base["time_to_target_median_s"] / s["time_to_target_median_s"]
    return {f"target_{metric}": target, "configs": configs}


def _cell(mean: float | None, sd: float | None, fmt: str) -> str:
    return "-" if mean is None else f"{mean:{fmt}} ± {sd:{fmt}}"


def table(profile: str, summary: dict) -> list[str]:
    loss = "target_loss" in summary
    head = (
        f"target validation loss {summary['target_loss']:.4f} (ddp's mean final plus {LOSS_MARGIN})"
        if loss
        else f"target test accuracy {summary['target_acc']:.4f} (ddp's mean final minus one point)"
    )
    lines = [
        f"### {profile}: {head}",
        "",
        f"| strategy | final {'validation loss' if loss else 'test accuracy'} | time to target s (all seeds) |"
        " median time to target s | reached | train wall s | throughput vs ddp | time to target vs ddp (medians) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary["configs"].items():
        vs = s.get("throughput_vs_ddp")
        tt = s.get("time_to_target_vs_ddp")
        final = _cell(s["final_loss_mean"], s["final_loss_sd"], ".4f") if loss else None
        lines.append(
            f"| {name} | {final or _cell(s['final_acc_mean'], s['final_acc_sd'], '.4f')} |"
            f" {_cell(s['time_to_target_mean_s'], s['time_to_target_sd_s'], '.1f')} |"
            f" {'-' if s['time_to_target_median_s'] is None else format(s['time_to_target_median_s'], '.1f')} |"
            f" {s['reached_target']}/{s['seeds']} | {s['median_train_wall_s']:.1f} |"
            f" {'-' if vs is None else f'{vs:.2f}x'} | {'-' if tt is None else f'{tt:.2f}x'} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--profiles", default=DEFAULT_PROFILES)
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None, help="the results' name (default: the task's)")
    p.add_argument("--task", choices=sorted(TASK_ARGS), default="digits")
    p.add_argument("--step-ms", type=float, default=30.0, help="a 1x step's sleep")
    p.add_argument("--per-sample-ms", type=float, default=0.0, help="and per sample (a step that grows with its batch)")
    a = p.parse_args()
    a.name = a.name or a.task
    args = (
        TASK_ARGS[a.task]
        + ["--step-ms", str(a.step_ms)]
        + (["--per-sample-ms", str(a.per_sample_ms)] if a.per_sample_ms else [])
    )
    names = a.configs.split(",")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for profile in a.profiles.split(","):
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for seed in range(a.seeds):
            for name in names:  # interleaved, so drifts of the machine hit every configuration alike
                r = run(CONFIGS[name] + args + ["--seed", str(seed)], a.epochs, PROFILES[profile])
                runs[name].append(r)
                print(
                    f"{profile:12s} seed {seed} {name:36s} train {r['train_wall_s']:5.1f}s"
                    f"  test acc {r['val_acc']:.4f}  loss {r['val_loss']:.4f}",
                    flush=True,
                )
        results[profile] = summarize(runs, "loss" if a.task == "text" else "acc")
        meta = {
            "epochs": a.epochs,
            "seeds": a.seeds,
            "args": args,
            "profiles": {k: PROFILES[k] for k in results},
        }
        (out / f"{a.name}.json").write_text(json.dumps({"meta": meta, "profiles": results}, indent=1))
    what = "Python's sources, byte-level transformer (AdamW)" if a.task == "text" else "scikit-learn digits, small CNN"
    lines = [
        f"{what}, GPU-like regime ({a.step_ms:g} ms + {a.per_sample_ms:g} ms per sample per 1x"
        f" step), {a.epochs} epochs, {a.seeds} seeds"
        " (mean ± sd), configurations interleaved.",
        "",
    ]
    for profile, summary in results.items():
        lines += table(profile, summary) + [""]
    (out / f"{a.name}.md").write_text("\n".join(lines))
    plot(results, out / f"{a.name}.png")  # test loss against training time
    plot(results, out / f"{a.name}_accuracy.png", accuracy=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
