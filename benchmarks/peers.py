"""oscars beside the peers a user would pick instead, on the same task, cluster and samples.

    pip install -e ".[bench]"      # matplotlib and torchft
    python -m benchmarks.peers --regime gpu-like
    python -m benchmarks.peers --regime cpu --profiles 1x/1x,1x/3x

The peers run in plain training loops, one process per rank, as their documentation shows them:

- ``torchft-localsgd``: torchft's ``LocalSGD`` (each rank its own replica group; the lighthouse started here on
  127.0.0.1 and stopped after the run), averaging every ``sync_every`` optimizer steps;
- ``torchft-diloco``: torchft's ``DiLoCo`` with its outer SGD (Nesterov momentum 0.9, lr 0.7) and a synchronous
  quorum;
- ``torch-averager``: torch's ``PeriodicModelAverager`` on a gloo group (what Lightning's post-local-SGD wraps);
- ``torch-ddp``: ``DistributedDataParallel`` in a plain loop, to separate Lightning's own per-step cost.

Lightning's ``ddp`` and ``oscars`` (at its defaults) run through ``benchmarks.train_job``. Every configuration
trains ``BenchModule``'s network from the same seed with its optimizer (SGD, momentum 0.9), on the same shards
(``DistributedSampler``, seed 0), for the same number of epochs, with the same emulated devices
(``benchmarks.task.EmulatedDevice``). Validation pauses the training clock everywhere.

Each peer's ``sync_every`` is swept over ``--sync-every`` once (the sweep's first run), the best by time to the
target accuracy (then throughput) is repeated up to ``--repeats`` runs, and reported at its median. The fixed
peers need every rank to take the same number of steps, so the fast ranks wait at each averaging; the plain loops
evaluate rank 0's model, which is the averaged one whenever a validation point falls on an averaging.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from benchmarks.heterogeneous import PROFILES, REGIMES, plot, ranks_of, run, summarize
from benchmarks.ports import free_port
from benchmarks.tables import markdown_table

PEERS = ("torchft-localsgd", "torchft-diloco", "torch-averager")
PLAIN = ("torch-ddp",)
LIGHTNING = {"ddp": ["--strategy", "ddp"], "oscars": ["--strategy", "oscars"]}
PEER_PROFILES = {"1x/1x": "", **{k: v for k, v in PROFILES.items() if k != "homogeneous"}}
RUN_TIMEOUT_S = 600.0


# ---------------------------------------------------------------------------------------------------- one rank


def _regime_value(args: list[str], flag: str, default: float) -> float:
    return float(args[args.index(flag) + 1]) if flag in args else default


def train_rank(a: argparse.Namespace) -> None:
    """One rank of a plain-loop peer; writes its accounting to ``a.out``."""
    import torch

    torch.set_num_threads(1)
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    from benchmarks.task import BenchModule, EmulatedDevice, make_dataset

    torch.manual_seed(0)  # the init train_job's seed_everything(0) gives BenchModule
    module = BenchModule(hidden=a.hidden, n_train=a.n_train)
    model: nn.Module = module.net
    optimizer = module.configure_optimizers()
    data = make_dataset(a.n_train, seed=0)
    sampler = DistributedSampler(data, num_replicas=a.world, rank=a.rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=module.hparams.batch_size, sampler=sampler)
    val_x, val_y = make_dataset(4096, seed=1).tensors
    device = EmulatedDevice(a.rank, a.slowdown, a.step_ms, a.jitter)
    device.calibrate(model, module.hparams.batch_size)

    manager = wrapper = averager = None
    store = None
    if a.algo.startswith("torchft"):
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo, LocalSGD

        # Manager connects to an existing store (is_master=False): every replica group starts its own.
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
            load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), optimizer.load_state_dict(sd["optim"])),
            state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
            min_replica_size=a.world,
            use_async_quorum=a.algo == "torchft-localsgd",  # torchft's default; DiLoCo requires a synchronous one
            init_sync=False,  # identical seeds: no replica needs to fetch another's weights at step 0
            replica_id=f"replica_{a.rank}",
            lighthouse_addr=a.lighthouse,
            store_addr="127.0.0.1",
            store_port=store.port,
            rank=0,
            world_size=1,
            hostname="127.0.0.1",
            timeout=timedelta(seconds=60),
            quorum_timeout=timedelta(seconds=120),
            connect_timeout=timedelta(seconds=30),
        )
        if a.algo == "torchft-localsgd":
            wrapper = LocalSGD(manager, model, optimizer, sync_every=a.sync_every)
        else:
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            wrapper = DiLoCo(
                manager, [model], optimizer, outer, sync_every=a.sync_every, backup_device=torch.device("cpu")
            )
        # Join the first quorum (which configures the replicas' process group) before the clock starts, as
        # Lightning's process group is set up before its training clock starts.
        manager.start_quorum()
        manager.wait_quorum()
    else:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{a.port}",
            rank=a.rank,
            world_size=a.world,
            timeout=timedelta(seconds=120),
        )
        if a.algo == "torch-averager":
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

            # fires after optimizer steps sync_every, 2 * sync_every, ... as LocalSGD does
            averager = PeriodicModelAverager(period=a.sync_every, warmup_steps=a.sync_every - 1)
        else:
            model = nn.parallel.DistributedDataParallel(model)

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            acc = sum(
                (model(x).argmax(-1) == y).sum().item() for x, y in zip(val_x.split(512), val_y.split(512))
            ) / len(val_y)
        model.train()
        return acc

    steps_per_epoch = len(loader)
    check_every = max(1, round(a.val_check_interval * steps_per_epoch))
    curve: list[tuple[float, float, float]] = []
    syncs, sync_s, paused = 0, 0.0, 0.0
    if wrapper is not None:
        wrapper.__enter__()
    start = time.perf_counter()
    try:
        for epoch in range(a.epochs):
            sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                device.step(time.perf_counter() - start - paused)
                before = manager.current_step() if manager is not None else 0
                t0 = time.perf_counter()
                optimizer.step()  # torchft averages in its post-step hook
                if averager is not None:
                    synced = averager.step >= averager.warmup_steps and (
                        (averager.step - averager.warmup_steps) % averager.period == 0
                    )
                    averager.average_parameters(model.parameters())
                else:
                    synced = manager is not None and manager.current_step() != before
                if synced:
                    syncs += 1
                    sync_s += time.perf_counter() - t0
                if (i + 1) % check_every == 0 or i + 1 == steps_per_epoch:
                    t_val = time.perf_counter()
                    clock = t_val - start - paused  # training seconds so far, validation excluded
                    curve.append((clock, float("nan"), evaluate()))
                    paused += time.perf_counter() - t_val
    finally:
        if wrapper is not None:
            wrapper.__exit__(None, None, None)
    wall = time.perf_counter() - start - paused
    result = {
        "wall_s": wall,
        "curve": curve,
        "syncs": syncs,
        "sync_s": sync_s,
        "solo_step_s": device.solo_step_s,
        "start_factor": device.factor_at(0.0),
        "real_steps": device.real_steps,
        "busy_s": device.busy_s,
        # equal on every rank when the last step averaged: the check that the peer really averages
        "param_checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }
    Path(a.out).write_text(json.dumps(result))
    if manager is not None:
        manager.shutdown(wait=False)
    elif torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------------- one run


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def run_peer(algo: str, sync_every: int, regime_args: list[str], epochs: int, slowdown: str) -> dict:
    """One plain-loop run of ``algo``; every rank in its own session, all killed if anything goes wrong."""
    world = ranks_of(slowdown)
    tmp = Path(tempfile.mkdtemp(prefix="oscars_peers_"))
    lighthouse = None
    procs: list[subprocess.Popen] = []
    logs = []
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", RUST_LOG="warn")
    ok = False
    try:
        if algo.startswith("torchft"):
            os.environ.setdefault("RUST_LOG", "warn")  # read once, when torchft's extension starts logging
            from torchft.coordination import LighthouseServer

            lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=world, join_timeout_ms=100)
            # address() names the host; the replicas reach it on loopback
            where = ["--lighthouse", "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]]
        else:
            where = ["--port", str(free_port())]
        step_ms = _regime_value(regime_args, "--step-ms", 0.0)
        hidden = int(_regime_value(regime_args, "--hidden", 512))
        n_train = int(_regime_value(regime_args, "--n-train", 16384))
        val = _regime_value(regime_args, "--val-check-interval", 0.25)
        for rank in range(world):
            cmd = [sys.executable, "-m", "benchmarks.peers", "--worker", "--algo", algo, "--rank", str(rank)]
            cmd += ["--world", str(world), "--sync-every", str(sync_every), "--slowdown", slowdown, *where]
            cmd += ["--step-ms", str(step_ms), "--hidden", str(hidden), "--n-train", str(n_train)]
            cmd += ["--epochs", str(epochs), "--val-check-interval", str(val), "--out", str(tmp / f"{rank}.json")]
            log = open(tmp / f"{rank}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        if failed:
            logs[failed[0]].seek(0)
            tail = logs[failed[0]].read()[-3000:]
            raise RuntimeError(f"{algo} sync_every={sync_every} {slowdown!r}: rank {failed[0]} failed\n{tail}")
        ranks = [json.loads((tmp / f"{r}.json").read_text()) for r in range(world)]
        ok = True
    finally:
        for proc in procs:
            _kill_group(proc)
        if lighthouse is not None:
            lighthouse.shutdown()
        for log in logs:
            log.close()
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
    return peer_summary(algo, sync_every, ranks)


def peer_summary(algo: str, sync_every: int, ranks: list[dict]) -> dict:
    """The fields ``benchmarks.heterogeneous.summarize`` reads, from every rank's own accounting."""
    wall = max(r["wall_s"] for r in ranks)
    samples = sum(r["real_steps"] for r in ranks) * 64
    keys = ("solo_step_s", "start_factor", "real_steps", "busy_s", "wall_s")
    return {
        "strategy": algo,
        "sync_every": sync_every,
        "train_wall_s": wall,
        "samples": samples,
        "samples_per_s": samples / wall,
        "val_acc": ranks[0]["curve"][-1][2],
        "curve": ranks[0]["curve"],
        "schedule": [sync_every] * len(ranks),
        "rounds": ranks[0]["syncs"],
        "allreduce_s": None,
        "sync_s": [r["sync_s"] for r in ranks],
        "param_checksums": [r.get("param_checksum") for r in ranks],
        "cluster": [{k: r[k] for k in keys} for r in ranks],
        "history": None,
    }


# ---------------------------------------------------------------------------------------------------- the study


def _rank_key(summary: dict) -> tuple[float, float]:
    """Best first: reaching the target sooner, then more samples per second."""
    reach = summary["median_time_to_target_s"]
    return (reach if reach is not None else float("inf"), -summary["median_samples_per_s"])


def study(profile: str, regime: str, repeats: int, sync_values: list[int], peers: list[str]) -> dict:
    slowdown = PEER_PROFILES[profile]
    regime_args, epochs = REGIMES[regime]["args"], REGIMES[regime]["epochs"]

    def log(name: str, r: dict) -> None:
        print(
            f"{profile:12s} {name:26s} train {r['train_wall_s']:5.1f}s {r['samples_per_s']:6.0f} samples/s "
            f"val_acc {r['val_acc']:.4f}",
            flush=True,
        )

    runs: dict[str, list[dict]] = {}
    for _ in range(repeats):  # the fixed configurations, interleaved
        for name, args in LIGHTNING.items():
            r = run(args + regime_args, epochs, slowdown)
            runs.setdefault(name, []).append(r)
            log(name, r)
        for name in PLAIN:
            r = run_peer(name, 1, regime_args, epochs, slowdown)
            runs.setdefault(name, []).append(r)
            log(name, r)
    sweep: dict[str, dict[int, dict]] = {}
    for name in peers:
        for h in sync_values:
            r = run_peer(name, h, regime_args, epochs, slowdown)
            sweep.setdefault(name, {})[h] = r
            log(f"{name} (sync_every {h})", r)
    # rank the sweep on the fixed configurations' target: one definition for every row
    scored = summarize({**runs, **{f"{n}@{h}": [r] for n, by_h in sweep.items() for h, r in by_h.items()}})
    best = {n: min(by_h, key=lambda h: _rank_key(scored["configs"][f"{n}@{h}"])) for n, by_h in sweep.items()}
    for name, h in best.items():
        runs[name] = [sweep[name][h]]
    for _ in range(repeats - 1):
        for name, h in best.items():
            r = run_peer(name, h, regime_args, epochs, slowdown)
            log(f"{name} (sync_every {h})", r)
            runs[name].append(r)
    summary = summarize(runs)
    summary["sweep"] = {
        n: {
            h: {
                k: scored["configs"][f"{n}@{h}"][k]
                for k in ("median_samples_per_s", "median_time_to_target_s", "median_val_acc")
            }
            for h in by_h
        }
        for n, by_h in sweep.items()
    }
    summary["best_sync_every"] = best
    return summary


def _best_peer(summary: dict) -> str | None:
    named = [n for n in PEERS if n in summary["configs"]]
    return max(named, key=lambda n: summary["configs"][n]["median_samples_per_s"]) if named else None


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(profile: str, summary: dict) -> list[str]:
    configs = summary["configs"]
    best = _best_peer(summary)
    ref = configs[best] if best else None
    headers = ["configuration", "sync_every", "train wall s (runs)", "samples/s", "vs ddp", "vs best peer"]
    headers += ["of ideal", "idle s per rank", "to target s", "val acc", "delta pts"]
    rows = []
    for name, s in configs.items():
        idle = "/".join(f"{v:.1f}" for v in s["median_idle_s"]) if "median_idle_s" in s else "-"
        h = summary["best_sync_every"].get(name)
        vs_peer = s["median_samples_per_s"] / ref["median_samples_per_s"] if ref else None
        rows.append(
            [
                name,
                "auto" if name == "oscars" else (str(h) if h else "-"),
                f"{s['median_train_wall_s']:.1f} ({', '.join(str(w) for w in s['walls'])})",
                f"{s['median_samples_per_s']:.0f}",
                f"{_f(s['throughput_vs_ddp'], '.2f')}x",
                f"{_f(vs_peer, '.2f')}x",
                _f(s.get("median_fraction_of_ideal"), ".3f"),
                idle,
                _f(s["median_time_to_target_s"], ".1f"),
                f"{s['median_val_acc']:.4f}",
                _f(s["acc_delta_pts"], "+.2f"),
            ]
        )
    sweep_rows = [
        [
            n,
            h,
            f"{v['median_samples_per_s']:.0f}",
            _f(v["median_time_to_target_s"], ".1f"),
            f"{v['median_val_acc']:.4f}",
        ]
        for n, by_h in summary["sweep"].items()
        for h, v in by_h.items()
    ]
    return [
        f"### {profile}: slowdown `{PEER_PROFILES[profile] or 'none'}`, target accuracy "
        f"{_f(summary['target_acc'], '.4f')}",
        "",
        *markdown_table(headers, rows, "lllrrrrlrrr"),
        "",
        *(f"- {line}" for line in ratios(summary)),
        "",
        "Sweep (first run of each sync_every):",
        "",
        *markdown_table(["peer", "sync_every", "samples/s", "to target s", "val acc"], sweep_rows, "lrrrr"),
    ]


def ratios(summary: dict) -> list[str]:
    """The figures the README quotes: oscars against the best-tuned peer, and Lightning's own per-step cost."""
    configs = summary["configs"]
    lines = []
    best = _best_peer(summary)
    oscars = configs.get("oscars")
    if best and oscars:
        speed = oscars["median_samples_per_s"] / configs[best]["median_samples_per_s"]
        reached = [configs[n]["median_time_to_target_s"] for n in PEERS if n in configs]
        reached = [t for t in reached if t is not None]
        mine = oscars["median_time_to_target_s"]
        lead = f"{min(reached) / mine:.2f}x" if reached and mine else "not comparable (a target not reached)"
        lines.append(f"oscars against the fastest peer ({best}): {speed:.2f}x the samples/s; time to target: {lead}")
    if "ddp" in configs and "torch-ddp" in configs:
        lightning, plain = configs["ddp"], configs["torch-ddp"]
        steps = max(lightning["runs"][0]["real_steps"])
        walls = lightning["median_train_wall_s"], plain["median_train_wall_s"]
        extra_ms = 1e3 * (walls[0] - walls[1]) / steps
        lines.append(
            f"Lightning's own cost: ddp {walls[0]:.2f} s against a plain DDP loop's {walls[1]:.2f} s "
            f"({walls[0] / walls[1]:.2f}x, {extra_ms:.1f} ms per step)"
        )
    return lines


def report(data: dict, out: Path, name: str) -> None:
    """``name``.md and ``name``.png from the JSON a study wrote (``--report`` rebuilds them)."""
    meta, results = data["meta"], data["profiles"]
    setup = " ".join(meta["regime_args"]) or "real compute only"
    epochs = REGIMES[meta["regime"]]["epochs"]
    lines = [
        f"Regime `{meta['regime']}` ({setup}), {epochs} epochs, medians of up to {meta['repeats']} runs; the peers'"
        f" sync_every swept over {meta['sync_every']}.",
        "",
        "`of ideal` uses oscars' measured 1x step, which includes Lightning's per-step work: a plain loop can"
        " exceed 1. `vs best peer`: against the peer with the most samples/s. Idle per rank: train wall minus"
        " emulated device time.",
        "",
    ]
    for profile, summary in results.items():
        lines += table(profile, summary) + [""]
    (out / f"{name}.md").write_text("\n".join(lines))
    plot(results, out / f"{name}.png", accuracy=True)
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regime", choices=sorted(REGIMES), default="gpu-like")
    p.add_argument("--profiles", default="1x/1x,1x/3x,1x/5x,volatile,1x/1x/2x/4x")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sync-every", default="4,8,16,32", help="the peers' sweep")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None, help="default: peers (gpu-like), peers_cpu (cpu)")
    # one rank of a plain-loop run (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for flag, kind in (
        ("--algo", str),
        ("--rank", int),
        ("--world", int),
        ("--slowdown", str),
        ("--lighthouse", str),
        ("--port", int),
        ("--step-ms", float),
        ("--hidden", int),
        ("--n-train", int),
        ("--epochs", int),
        ("--val-check-interval", float),
        ("--jitter", float),
    ):
        p.add_argument(flag, type=kind, default=0.0 if kind is float else None, help=argparse.SUPPRESS)
    p.add_argument("--report", metavar="JSON", help="only rebuild the markdown and the plot from a study's JSON")
    a = p.parse_args()
    if a.report:
        path = Path(a.report)
        report(json.loads(path.read_text()), path.parent, a.name or path.stem)
        return
    if a.worker:
        a.sync_every = int(a.sync_every)
        train_rank(a)
        return
    name = a.name or ("peers" if a.regime == "gpu-like" else "peers_cpu")
    sync_values = [int(x) for x in a.sync_every.split(",")]
    results = {
        profile: study(profile, a.regime, a.repeats, sync_values, a.peers.split(","))
        for profile in a.profiles.split(",")
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "regime": a.regime,
        "regime_args": REGIMES[a.regime]["args"],
        "repeats": a.repeats,
        "sync_every": sync_values,
        "profiles": {k: PEER_PROFILES[k] for k in results},
    }
    data = {"meta": meta, "profiles": results}
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    report(json.loads(json.dumps(data)), out, name)  # as --report reads it back


if __name__ == "__main__":
    main()
