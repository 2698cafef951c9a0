"""Where oscars' time goes: the gap between a run's training wall time and a perfectly balanced cluster's, split
by kind of round, from the round histories a benchmark run stores.

    python -m benchmarks.loss_breakdown benchmarks/results/gpu_like.json

For every oscars run, the ideal time of its samples is ``samples / ideal samples per second`` (``sum_i batch /
t_i``, the fraction-of-ideal definition). Each averaging's record gives the round's duration (training time,
validation excluded) and its samples, so each round's loss is ``duration - samples / ideal rate``. Rounds are:

* ``warm-up``: the first round, equal steps on every rank while speeds are measured;
* ``cut``: rounds well short of the schedule's (under three quarters of its steps: an averaging before
  validation, at an epoch end, or a re-planned epoch tail): their imbalance is not the schedule's;
* ``steady``: full rounds. Their loss splits exactly into five parts, from the record's figures:

  - ``all-reduce``: the averaging, measured per round;
  - ``fixed``: the rest of the round outside the busiest rank's own steps (``duration - all-reduce - max_i
    compute_i``): Lightning's work at the round's edges, the control data, the averaging's copies;
  - ``stragglers``: the busiest rank's steps beyond what the round's median step times predict (``max_i compute_i
    - max_i tau_i t_i``, ``tau_i`` the steps rank ``i`` took): per-step jitter and no-op slots between its steps;
  - ``rounding``: whole steps cannot fill the period exactly (``max_i tau_i t_i - sum_i tau_i / sum_i 1/t_i``);
  - ``speed``: the round's median step times against the benchmark's ideal (``sum_i tau_i / sum_i 1/t_i -
    samples / ideal rate``): negative when the ranks ran faster than the runs' median base time;

* ``after``: training time after the last averaging (the end of fit); slightly negative because the strategy's
  clock starts a few tens of milliseconds before the benchmark's.

Medians over the repeats of every profile, in seconds and as shares of the wall time; a second table gives the
same losses per averaging (milliseconds per steady round and per cut round, and how many of each), the unit in
which the strategy pays them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.tables import markdown_table

__all__ = ["breakdown"]

KINDS = ("warm-up", "cut", "all-reduce", "fixed", "stragglers", "rounding", "speed", "after")


def breakdown(run: dict) -> dict[str, float]:
    """Seconds lost per kind of round in one run (see the module docstring), plus ``wall`` and ``ideal``."""
    rate = run["ideal_samples_per_s"]
    history = run["history"]
    lost = dict.fromkeys(KINDS, 0.0)
    counts = {"steady rounds": 0, "cut rounds": 0}
    previous = 0.0
    for index, record in enumerate(history):
        duration = record["time"] - previous
        previous = record["time"]
        samples = sum(record["samples"])
        loss = duration - samples / rate
        batch = run["samples"] / max(1, sum(run["real_steps"]))
        # A deadline round trains about, not exactly, the schedule's steps: "cut" means well short of them.
        full = samples >= 0.75 * batch * sum(record["local_steps"])
        if index == 0:
            lost["warm-up"] += loss
        elif not full:
            lost["cut"] += loss
            counts["cut rounds"] += 1
        else:
            counts["steady rounds"] += 1
            allreduce = record["allreduce_time"]
            busiest = max(record["compute_times"])
            # the steps each rank took (a deadline round's differ from its plan's)
            tau, times = [n / batch for n in record["samples"]], record["step_times"]
            period = max(k * t for k, t in zip(tau, times))
            balanced = sum(tau) / sum(1.0 / t for t in times)
            lost["all-reduce"] += allreduce
            lost["fixed"] += duration - allreduce - busiest
            lost["stragglers"] += busiest - period
            lost["rounding"] += period - balanced
            lost["speed"] += balanced - samples / rate
    lost["after"] = run["train_wall_s"] - previous
    return {"wall": run["train_wall_s"], "ideal": run["samples"] / rate, **lost, **counts}


STEADY_PARTS = ("all-reduce", "fixed", "stragglers", "rounding", "speed")


def per_round(parts: dict[str, float]) -> dict[str, float]:
    """The losses of :func:`breakdown` per averaging: milliseconds per steady round for each steady part, and per
    cut round (0 where there is no such round)."""
    steady, cuts = parts["steady rounds"], parts["cut rounds"]
    out = {k: 1e3 * parts[k] / steady if steady else 0.0 for k in STEADY_PARTS}
    out["cut"] = 1e3 * parts["cut"] / cuts if cuts else 0.0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="a benchmarks.heterogeneous JSON file")
    p.add_argument("--config", default="oscars-exact-uniform")
    a = p.parse_args()
    data = json.loads(Path(a.results).read_text())
    rows, round_rows = [], []
    for profile, result in data["profiles"].items():
        runs = result["configs"].get(a.config, {}).get("runs") or []
        parts = [breakdown(r) for r in runs if r.get("history")]
        if not parts:
            continue
        med = {k: statistics.median(part[k] for part in parts) for k in parts[0]}
        wall = med["wall"]
        rows.append(
            [
                profile,
                f"{wall:.2f}",
                f"{med['ideal']:.2f} ({med['ideal'] / wall:.3f})",
                *(f"{med[k]:.2f} ({med[k] / wall:.1%})" for k in KINDS),
            ]
        )
        ms = {k: statistics.median(per_round(part)[k] for part in parts) for k in (*STEADY_PARTS, "cut")}
        round_rows.append(
            [
                profile,
                f"{med['steady rounds']:.0f}",
                *(f"{ms[k]:.1f}" for k in STEADY_PARTS),
                f"{med['cut rounds']:.0f}",
                f"{ms['cut']:.1f}",
            ]
        )
    headers = ["profile", "wall s", "ideal s (of wall)", *(f"{k} s" for k in KINDS)]
    print(f"{a.config} in {a.results}: seconds lost against a perfectly balanced cluster (share of the wall time)\n")
    print("\n".join(markdown_table(headers, rows, "lrr" + "r" * len(KINDS))))
    headers = ["profile", "steady rounds", *(f"{k} ms/round" for k in STEADY_PARTS), "cut rounds", "cut ms/round"]
    print("\nThe same per averaging (medians over the runs)\n")
    print("\n".join(markdown_table(headers, round_rows, "l" + "r" * (len(headers) - 1))))


if __name__ == "__main__":
    main()
