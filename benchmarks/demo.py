"""The demo: an emulated heterogeneous 2-rank cluster on this machine, trained with ddp and with oscars.

    python -m benchmarks.demo            # about a minute on 2 CPU cores, offline

Both runs train the same model on the same data (benchmarks/task.py) for the same number of epochs, with
rank 1 emulated 3x slower. Prints a table (training wall time, samples/s, fraction of ideal throughput, idle time
per rank, final validation accuracy, speed-up) and writes a plot of validation loss against training wall time
for both to benchmarks/results/demo.png, oscars' schedule as a timeline to demo_timeline.png (one lane per rank:
real steps, waiting, averaging) and the figures to demo.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.heterogeneous import CONFIGS, plot, run, summarize
from lightning_oscars import plot_timeline


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slowdown", default="1:3", help="rank:factor, e.g. 1:3 (rank 1 three times slower)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()
    names = {"ddp": "ddp", "oscars": "oscars-exact-uniform"}
    runs: dict[str, list[dict]] = {}
    for i, (label, config) in enumerate(names.items(), 1):
        print(
            f"\n[{i}/{len(names)}] training with strategy={label!r} on 2 ranks, slowdown {a.slowdown} ...", flush=True
        )
        runs[label] = [run(CONFIGS[config], a.epochs, a.slowdown, show=True)]
    # summarize() takes the unslowed step time from oscars runs, whose names start with "oscars".
    summary = summarize(runs)
    ddp, oscars = summary["configs"]["ddp"], summary["configs"]["oscars"]
    rows = [
        ("training wall time (s)", "median_train_wall_s", ".1f"),
        ("samples/s", "median_samples_per_s", ".0f"),
        ("fraction of ideal", "median_fraction_of_ideal", ".1%"),
        ("final validation accuracy", "median_val_acc", ".4f"),
    ]
    print(f"\n{'':28s}{'ddp':>14s}{'oscars':>14s}")
    for title, key, fmt in rows:
        print(f"{title:28s}{format(ddp[key], fmt):>14s}{format(oscars[key], fmt):>14s}")
    idle = [" / ".join(f"{v:.1f}" for v in s["median_idle_s"]) for s in (ddp, oscars)]
    print(f"{'idle time per rank (s)':28s}{idle[0]:>14s}{idle[1]:>14s}")
    print(f"{'oscars local steps (tau)':28s}{'-':>14s}{str(oscars['schedule']):>14s}")
    speedup = ddp["median_train_wall_s"] / oscars["median_train_wall_s"]
    monitor = oscars["runs"][0].get("monitor_fraction_of_ideal")
    if monitor is not None:  # the same definition over the rounds' records; Lightning's summary above prints it
        print(f"{'(oscars, its own records)':28s}{'':>14s}{monitor:>14.1%}")
    print(f"\nspeed-up of oscars over ddp: {speedup:.2f}x in wall time for the same {a.epochs} epochs")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    plot({f"1x/{a.slowdown.split(':')[-1]}x": summary}, out / "demo.png")
    (out / "demo.json").write_text(json.dumps(summary, indent=1))
    print(f"plot of validation loss against wall time: {out / 'demo.png'}")
    history = oscars["runs"][0].get("history")
    if history:
        plot_timeline(history, out / "demo_timeline.png", title=f"oscars, slowdown {a.slowdown}", max_rounds=40)
        print(f"oscars' schedule, round by round: {out / 'demo_timeline.png'}")


if __name__ == "__main__":
    main()
