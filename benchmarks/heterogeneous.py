"""Heterogeneous speed-up, side by side: ddp, fixed-period local SGD and oscars on emulated clusters of 2 or 4 CPU
ranks, in two regimes, for several slowdown profiles, several repeats, medians and ratios from one invocation.

    python -m benchmarks.heterogeneous --regime cpu --repeats 3
    python -m benchmarks.heterogeneous --regime gpu-like --repeats 3
    python -m benchmarks.heterogeneous --profiles 1x/3x --configs ddp,oscars-exact-uniform --repeats 1

Regimes (benchmarks/task.py): ``cpu``, every step real compute (3-4 ms, the ranks contend for the 2 cores);
``gpu-like``, every step mostly a 30 ms sleep at 1x (as a host waiting for its GPU) beside a small model, so
even 4 ranks share 2 cores without contention and what remains is the strategies' own cost.

Definitions (the same for every strategy; see benchmarks/README.md):
* train wall: from the end of each rank's start-up calibration to the end of training (slowest rank), time
  spent in validation excluded (the same validation runs under every strategy).
* step time of a rank ``t_i``: seconds per real optimizer step when it does not wait for anybody, as oscars
  measures it (median over the oscars runs of the profile); an emulated ``k``x rank adds ``(k-1)`` times its
  calibrated device time per step. busy_i = real steps_i x t_i.
* of ideal: ``lightning_oscars.core.control.fraction_of_ideal`` = samples/s over ``sum_i batch / t_i``; the strategy's
  end-of-fit summary prints the same figure (recorded as ``monitor_fraction_of_ideal``).
* local_sgd-matched: fixed-period local SGD with the number of averagings per epoch of the oscars run just
  before it (``max_local_steps`` = oscars' mean final tau); it must follow an oscars config in ``--configs``.
* time to target: first validation whose accuracy reaches the target, ddp's median final accuracy minus 1 point.
Writes benchmarks/results/<name>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

# The runs' figures live in a module of their own; re-exported here, where callers import them from.
from benchmarks.heterogeneous_summary import base_step_time, cluster_figures, summarize, time_to  # noqa: F401
from benchmarks.ports import free_port
from benchmarks.tables import markdown_table


def _ripples(**options: str) -> list[str]:
    return ["--strategy", "ripples", *(arg for k, v in options.items() for arg in ("--option", f"{k}={v}"))]


CONFIGS = {
    "ddp": ["--strategy", "ddp"],
    "local_sgd": ["--strategy", "local_sgd"],
    "oscars-exact-uniform": ["--strategy", "oscars", "--solver", "exact", "--averaging", "uniform"],
    "oscars-batch": ["--strategy", "oscars", "--option", "balance=batch"],
    # memory caps 2:1 on 2 ranks (the per-rank batch sizes of issue 44): ddp at the smaller rank's batch, and batch
    # balancing whose global batch uses both ranks' memory (caps 64 and 32, 48 per rank on average)
    "ddp-b32": ["--strategy", "ddp", "--batch-size", "32"],
    "oscars-batch-caps-64-32": ["--strategy", "oscars", "--option", "balance=batch"]
    + ["--option", "batch_sizes=[64,32]", "--batch-size", "48"],
    # the same memories under local steps: oscars at the smaller batch on both, and each rank on its own batch size
    "oscars-b32": ["--strategy", "oscars", "--batch-size", "32"],
    "oscars-caps-64-32": ["--strategy", "oscars", "--option", "batch_sizes=[64,32]", "--batch-size", "32"],
    "oscars-exact-samples": ["--strategy", "oscars", "--solver", "exact", "--averaging", "samples"],
    "oscars-alg1-uniform": ["--strategy", "oscars", "--solver", "alg1", "--averaging", "uniform"],
    "oscars-alg1-samples": ["--strategy", "oscars", "--solver", "alg1", "--averaging", "samples"],
    "local_sgd-matched": ["--strategy", "oscars", "--solver", "uniform"],  # + max_local_steps, see matched_args
    # the levers, each on top of oscars-exact-uniform
    "oscars-deadline": ["--strategy", "oscars", "--option", "deadline_rounds=true"],
    "oscars-diloco": ["--strategy", "oscars", "--option", "outer_lr=0.7"],
    "oscars-overlap": ["--strategy", "oscars", "--option", "overlap_averaging=true"],
    # replica groups: 2 consecutive ranks train as one replica (DDP inside), the rounds balance the replicas
    "oscars-replica-2": ["--strategy", "oscars", "--option", "replica_size=2"],
    "oscars-replica-node": ["--strategy", "oscars", "--option", "replica_size=node"],
    # sharded replicas: the same, each replica's model sharded between its ranks with FSDP2
    "oscars-sharded-2": ["--strategy", "oscars", "--option", "replica_size=2", "--option", "shard_replicas=true"],
    # the same, FSDP2 keeping each unit's gathered parameters from the forward to the backward (one all-gather less)
    "oscars-sharded-2-keep": ["--strategy", "oscars", "--option", "replica_size=2", "--option", "shard_replicas=true"]
    + ["--option", 'shard_options={"reshard_after_forward": false}'],
    "oscars-sharded-node": [
        "--strategy",
        "oscars",
        "--option",
        "replica_size=node",
        "--option",
        "shard_replicas=true",
    ],
    "local_sgd-replica-2": ["--strategy", "oscars", "--solver", "uniform", "--option", "replica_size=2"],
    # the spread bound: 16 is the default since it was measured beside 8 (docs/benchmarks.md, Decisions); 8 held the
    # round at 1x/3x to [10, 3] and at 1x/5x to [12, 5], too short to amortise the all-reduce where steps are short
    "oscars-spread-16": ["--strategy", "oscars", "--option", "max_spread=16"],
    "oscars-spread-8": ["--strategy", "oscars", "--option", "max_spread=8"],
    # twice the default cap on local steps (and a spread bound that lets the cap bind): rounds twice as long
    "oscars-cap-32": ["--strategy", "oscars", "--option", "max_local_steps=32", "--option", "max_spread=32"],
    # longer rounds: the solver accepts less throughput for shorter rounds (and may take up to 32 local steps)
    "oscars-tolerance-1pct": ["--strategy", "oscars", "--option", "efficiency_tolerance=0.01"],
    "oscars-tolerance-half-pct-32": ["--strategy", "oscars", "--option", "efficiency_tolerance=0.005"]
    + ["--option", "max_local_steps=32"],
    # the parameter-server paradigms (lightning_oscars.lightning.paradigms), at their defaults unless named
    "bsp": ["--strategy", "bsp"],
    "asp": ["--strategy", "asp"],
    "ssp-3": ["--strategy", "ssp", "--option", "staleness=3"],
    "ssp-15": ["--strategy", "ssp", "--option", "staleness=15"],
    "dssp": ["--strategy", "dssp"],
    # where the momentum lives under a stale server: on the server (workers on plain SGD), or nowhere
    "ssp-3-server-momentum": ["--strategy", "ssp", "--option", "staleness=3", "--option", "server_momentum=0.9"]
    + ["--momentum", "0"],
    "ssp-3-no-momentum": ["--strategy", "ssp", "--option", "staleness=3", "--momentum", "0"],
    "ssp-15-server-momentum": ["--strategy", "ssp", "--option", "staleness=15", "--option", "server_momentum=0.9"]
    + ["--momentum", "0"],
    "asp-server-momentum": ["--strategy", "asp", "--option", "server_momentum=0.9", "--momentum", "0"],
    "dasp": ["--strategy", "dasp"],
    # the decentralized paradigm: Ripples' partial all-reduce in groups
    # (the seed's synchronous partial all-reduce, and with the exchange overlapped with the next step: the default)
    # (named in full: the figures of each config were measured so, whatever the defaults become)
    "ripples-smart": _ripples(generator="smart", overlap="false", timed_warmup="false"),
    "ripples-random": _ripples(generator="random", overlap="false", timed_warmup="false"),
    "ripples-smart-overlap": _ripples(generator="smart", overlap="true", timed_warmup="false"),
    "ripples-smart-overlap-timed-warmup": _ripples(generator="smart", overlap="true", timed_warmup="true"),
}
PARADIGM_CONFIGS = (
    "bsp",
    "asp",
    "ssp-3",
    "ssp-15",
    "dssp",
    "dasp",
    "ripples-smart",
    "ripples-random",
    "ripples-smart-overlap",
)
PROFILES = {
    "homogeneous": "",
    "1x/2x": "1:2",
    "1x/3x": "1:3",
    "1x/5x": "1:5",
    # rank 1 starts 3x slower; after 3 s the ranks swap speeds
    "volatile": "1:3@0,1@3;0:1@0,3@3",
    # 4 ranks of three speeds
    "1x/1x/2x/4x": "2:2;3:4",
    # 4 ranks, one of them slow or changing (the paradigm benchmark's 4-rank cluster)
    "4r-equal": "3:1",
    "4r-one-2x": "3:2",
    "4r-one-5x": "3:5",
    "4r-volatile": "3:3@0,1@3;0:1@0,3@3",
    # 2 "nodes" of 2 ranks, the second node 3x slower (replica groups' benchmark)
    "2x2-one-node-3x": "2:3;3:3",
}
REGIMES = {
    "cpu": {"args": [], "epochs": 4},
    "gpu-like": {
        "args": ["--step-ms", "30", "--hidden", "128", "--n-train", "8192", "--val-check-interval", "0.5"],
        "epochs": 2,
    },
    # a step whose time grows with its batch, as on a GPU: 5 ms + 1 ms per sample at 1x (69 ms for a batch of 64);
    # the regime of balance="batch", which gives a fast rank a larger share of ddp's global batch
    "gpu-like-batch": {
        "args": ["--step-ms", "5", "--per-sample-ms", "1", "--hidden", "128", "--n-train", "8192"]
        + ["--val-check-interval", "0.5"],
        "epochs": 2,
    },
    # a step with a large fixed part (a GPU that small batches leave under-used): 20 ms + 0.25 ms per sample at 1x
    "gpu-like-fixed": {
        "args": ["--step-ms", "20", "--per-sample-ms", "0.25", "--hidden", "128", "--n-train", "8192"]
        + ["--val-check-interval", "0.5"],
        "epochs": 2,
    },
    # the same with 16 MB of parameters (4M floats) that take no compute: a model whose all-reduce weighs, as a
    # large model's does over a network (ddp carries it every step, averaging once per round)
    "gpu-like-heavy": {
        "args": ["--step-ms", "30", "--hidden", "128", "--n-train", "8192", "--val-check-interval", "0.5"]
        + ["--ballast-mb", "16"],
        "epochs": 2,
    },
}


def ranks_of(slowdown: str) -> int:
    """The cluster size a profile names: its highest rank + 1, at least 2."""
    return max([2] + [int(part.split(":")[0]) + 1 for part in filter(None, slowdown.split(";"))])


def matched_args(oscars_run: dict) -> list[str]:
    """Fixed-period local SGD with as many averagings per epoch as ``oscars_run``: a round of ``n`` ranks x ``H``
    batches consumes what an oscars round of ``sum(tau)`` does when ``H = mean(tau)``."""
    tau = oscars_run["schedule"]
    return ["--option", f"max_local_steps={max(1, round(sum(tau) / len(tau)))}"]


def _launch(job: list[str], nodes: int, env: dict[str, str], log: Path | None) -> int:
    """Run ``job`` (train_job's arguments) to its end: through Lightning's launcher, or as ``nodes`` torchrun agents
    on loopback (one per emulated node, as a cluster starts them). Output goes to ``log`` (``None``: this terminal).
    Returns the first non-zero exit code, else 0."""
    with open(log, "w") if log is not None else nullcontext() as sink:
        if nodes == 1:
            return subprocess.run(job, timeout=900, env=env, stdout=sink, stderr=subprocess.STDOUT).returncode
        port, per_node = free_port(), int(job[job.index("--devices") + 1])
        agents = [
            subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={per_node}"]
                + [f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", *job[1:]],
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
            for node in range(nodes)
        ]
        try:
            codes = [agent.wait(timeout=900) for agent in agents]
        finally:
            for agent in agents:
                if agent.poll() is None:
                    agent.kill()
        return next((c for c in codes if c), 0)


def run(args: list[str], epochs: int, slowdown: str, show: bool = False, nodes: int = 1) -> dict:
    """One training run in a fresh process group (``nodes`` > 1: started by torchrun, one agent per node); returns
    rank 0's JSON summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        ranks = ranks_of(slowdown)
        if ranks % nodes:
            raise ValueError(f"{ranks} ranks do not split into {nodes} nodes")
        cmd = [sys.executable, "-m", "benchmarks.train_job", *args, "--epochs", str(epochs), "--out", str(out)]
        cmd += ["--slowdown", slowdown, "--devices", str(ranks // nodes), "--num-nodes", str(nodes)]
        cmd += ["--progress"] if show else []
        leaked = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")
        env = {k: v for k, v in os.environ.items() if k not in leaked}
        env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        log = None if show else Path(tmp) / "run.log"
        for attempt in (1, 2):
            code = _launch(cmd, nodes, env, log)
            if code == 0 or out.exists():
                # A run that wrote its result and then died (a process group's teardown at exit) still counts.
                if code != 0:
                    print(f"  (exit code {code} after writing its result: kept)", flush=True)
                return json.loads(out.read_text())
            tail = log.read_text()[-2000:] if log is not None else ""
            print(f"  run failed (exit code {code}, attempt {attempt} of 2):\n{tail}", flush=True)
        raise RuntimeError(f"{' '.join(cmd)} failed twice")


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(profile: str, summary: dict) -> list[str]:
    headers = ["strategy", "train wall s (runs)", "samples/s", "vs ddp", "vs matched", "of ideal", "idle s per rank"]
    headers += ["all-reduce ms", "rounds", "changes /100", "to target s", "vs ddp", "val acc", "delta pts", "final tau"]
    rows = []
    for name, s in summary["configs"].items():
        idle = "/".join(f"{v:.1f}" for v in s["median_idle_s"]) if "median_idle_s" in s else "-"
        rows.append(
            [
                name,
                f"{s['median_train_wall_s']:.1f} ({', '.join(str(w) for w in s['walls'])})",
                f"{s['median_samples_per_s']:.0f}",
                f"{_f(s['throughput_vs_ddp'], '.2f')}x",
                f"{_f(s['throughput_vs_local_sgd_matched'], '.2f')}x",
                _f(s.get("median_fraction_of_ideal"), ".3f"),
                idle,
                _f(s["median_allreduce_ms"], ".2f"),
                _f(s["median_rounds"], ".0f"),
                _f(s["median_changes_per_100_rounds"], ".1f"),
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
        *markdown_table(headers, rows, "llrrrrlrrrrrrrl"),
    ]


def plot(results: dict[str, dict], path: Path, accuracy: bool = False) -> None:
    """One panel per profile: every configuration's first run, validation loss (log scale) or accuracy (with the
    target as a dashed line) against training wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (profile, summary) in zip(axes[0], results.items()):
        for name, s in summary["configs"].items():
            curve = s["runs"][0]["curve"]
            ax.plot([c[0] for c in curve], [c[2 if accuracy else 1] for c in curve], marker=".", label=name)
        if accuracy and summary.get("target_acc") is not None:
            ax.axhline(summary["target_acc"], color="grey", lw=0.8, ls="--")
        ax.set_title(f"{profile} ({PROFILES.get(profile, '') or 'equal speeds'})")
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel("validation accuracy" if accuracy else "validation loss")
        if not accuracy:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regime", choices=sorted(REGIMES), default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=None, help="default: 4 (cpu), 2 (gpu-like)")
    p.add_argument("--profiles", default="1x/2x,1x/3x,1x/5x,volatile,homogeneous")
    replicas = ("oscars-replica-2", "oscars-replica-node", "local_sgd-replica-2")
    replicas += ("oscars-sharded-2", "oscars-sharded-2-keep", "oscars-sharded-node")  # 4-rank profiles only
    levers = ("local_sgd-matched", "oscars-deadline", "oscars-diloco", *replicas)
    p.add_argument("--configs", default=",".join(c for c in CONFIGS if c not in levers + PARADIGM_CONFIGS))
    p.add_argument("--jitter", type=float, default=0.0, help="lognormal log-spread of every rank's step times")
    p.add_argument("--option", action="append", default=[], help="extra OscarsStrategy option (key=JSON) for oscars")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="heterogeneous")
    p.add_argument("--torchrun-nodes", type=int, default=1, help="start every run as this many torchrun agents")
    return p


def _profile_runs(a: argparse.Namespace, profile: str, names: list[str], epochs: int) -> dict[str, list[dict]]:
    """Every configuration of ``names`` on one profile, ``a.repeats`` times."""
    regime = REGIMES[a.regime]
    extra = [x for pair in a.option for x in ("--option", pair)]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(a.repeats):
        last_oscars = None
        for name in names:  # interleaved, so drifts of the machine hit every configuration alike
            args = CONFIGS[name] + regime["args"] + (["--jitter", str(a.jitter)] if a.jitter else [])
            if name == "local_sgd-matched":
                if last_oscars is None:
                    raise SystemExit("local_sgd-matched must follow an oscars config in --configs")
                args = args + matched_args(last_oscars)
            elif name.startswith("oscars"):
                args = args + extra
            r = run(args, epochs, PROFILES[profile], nodes=a.torchrun_nodes)
            if name.startswith("oscars"):
                last_oscars = r
            runs[name].append(r)
            print(
                f"{profile:12s} [{i + 1}/{a.repeats}] {name:22s} train {r['train_wall_s']:5.1f}s "
                f"{r['samples_per_s']:6.0f} samples/s  val_acc {r['val_acc']:.4f}  tau {r['schedule']}"
                + (f"  shares {r['shares']['last']}" if r.get("shares") else ""),
                flush=True,
            )
    return runs


def _write_json(a: argparse.Namespace, results: dict[str, dict], epochs: int) -> Path:
    """``<out>/<name>.json``: the settings and every profile summarised so far; returns ``<out>``."""
    regime = REGIMES[a.regime]
    meta = {
        "regime": a.regime,
        "regime_args": regime["args"],
        "oscars_options": a.option,
        "jitter": a.jitter,
        "repeats": a.repeats,
        "epochs": epochs,
        "ranks": {k: ranks_of(PROFILES[k]) for k in results},
        "profiles": {k: PROFILES[k] for k in results},
        "launcher": f"torchrun, {a.torchrun_nodes} agents on loopback" if a.torchrun_nodes > 1 else "Lightning",
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps({"meta": meta, "profiles": results}, indent=1))
    return out


def _markdown(a: argparse.Namespace, results: dict[str, dict], epochs: int) -> list[str]:
    """The markdown: the settings, then a table per profile."""
    setup = " ".join(REGIMES[a.regime]["args"]) or "16,384 samples, real compute only"
    lines = [
        f"Regime `{a.regime}` ({setup}), {epochs} epochs, CPU ranks, {a.repeats} repeats (medians), interleaved.",
        f"oscars options: {' '.join(a.option) or 'defaults'}; per-step jitter (lognormal sigma): {a.jitter}.",
        "",
    ]
    for profile, summary in results.items():
        lines += table(profile, summary) + [""]
    return lines


def main() -> None:
    a = _parser().parse_args()
    epochs = a.epochs or REGIMES[a.regime]["epochs"]
    names = a.configs.split(",")
    results: dict[str, dict] = {}
    for profile in a.profiles.split(","):
        results[profile] = summarize(_profile_runs(a, profile, names, epochs))
        # Written after every profile: a long benchmark that breaks later keeps what it measured.
        out = _write_json(a, results, epochs)
    lines = _markdown(a, results, epochs)
    (out / f"{a.name}.md").write_text("\n".join(lines))
    plot(results, out / f"{a.name}.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
