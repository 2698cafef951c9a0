"""One training run on 2 emulated ranks; rank 0 writes a JSON summary. Used by benchmarks.heterogeneous and
benchmarks.demo.

    python -m benchmarks.train_job --strategy oscars --slowdown 1:3 --epochs 4 --out run.json
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import lightning_oscars  # noqa: E402,F401
from benchmarks.task import BenchModule  # noqa: E402
from lightning_oscars import OscarsStrategy  # noqa: E402
from lightning_oscars.lightning.monitor import run_fraction_of_ideal  # noqa: E402
from lightning_oscars.lightning.paradigms import PARADIGMS, ParameterServerStrategy, RipplesStrategy  # noqa: E402


def summarize(model: BenchModule, history: list[dict], batch_size: int) -> dict:
    """Every rank's own accounting, gathered; the derived figures (fraction of ideal, idle) are computed by
    benchmarks.heterogeneous.cluster_figures, with one definition for every strategy."""
    cluster = model.cluster
    wall = max(r["wall_s"] for r in cluster)
    samples = int(sum(r["samples"] for r in cluster))  # every rank's own count (shares differ under balance="batch")
    return {
        "train_wall_s": wall,
        "samples": samples,
        "samples_per_s": samples / wall,
        "real_steps": [int(r["real_steps"]) for r in cluster],
        "rank_samples": [int(r["samples"]) for r in cluster],
        "solo_step_ms": [1e3 * r["solo_step_s"] for r in cluster],
        "rounds": len(history),
        "schedule_changes": sum(1 for r in history if r["rebalanced"]),
    }


def strategy_options(pairs: list[str]) -> dict:
    """``--option max_local_steps=8 --option generator=smart``: values are JSON (numbers, booleans, lists), else
    strings."""
    options = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _stacks_on_sigusr2() -> None:
    """``OSCARS_STACKS_DIR=D``: ``kill -USR2`` a rank to write every thread's Python stack to ``D`` (a stuck run)."""
    import faulthandler
    import os
    import signal
    from pathlib import Path

    folder = os.environ.get("OSCARS_STACKS_DIR")
    if folder:
        sink = (Path(folder) / f"stacks-{os.getpid()}.txt").open("w")
        faulthandler.register(signal.SIGUSR2, file=sink, all_threads=True)


class EpochLines(L.Callback):
    """Progress where output is not a terminal (a log, a pipe): one line per epoch on rank 0, instead of a progress
    bar whose every redraw becomes a line of its own there."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            acc = trainer.callback_metrics.get("val_acc")
            shown = "-" if acc is None else f"{float(acc):.4f}"
            print(f"  epoch {trainer.current_epoch + 1}/{trainer.max_epochs}: val_acc {shown}", flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="oscars", help="ddp, local_sgd, oscars or a paradigm (asp, ssp, ...)")
    p.add_argument("--solver", default="exact")
    p.add_argument("--averaging", default="uniform")
    p.add_argument("--slowdown", default="1:3")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--val-check-interval", type=float, default=0.25)
    p.add_argument("--devices", type=int, default=2, help="ranks per node")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes (started by a cluster launcher such as torchrun)")
    p.add_argument("--step-ms", type=float, default=0.0, help="GPU-like regime: sleep this long in every step")
    p.add_argument("--per-sample-ms", type=float, default=0.0, help="GPU-like: and this long per sample")
    p.add_argument("--jitter", type=float, default=0.0, help="lognormal log-spread of every step's time")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--n-train", type=int, default=16384)
    p.add_argument("--ballast-mb", type=float, default=0.0, help="MB of extra parameters every all-reduce carries")
    p.add_argument("--option", action="append", default=[], help="OscarsStrategy option as key=JSON value")
    p.add_argument("--momentum", type=float, default=0.9, help="the workers' SGD momentum")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--task", default="gaussian", choices=("gaussian", "digits", "text"))
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    p.add_argument("--progress", action="store_true", help="show Lightning's progress bar")
    p.add_argument("--out", required=True)
    return p


def _strategy(a: argparse.Namespace) -> object:
    """The strategy ``--strategy`` names: oscars or a parameter-server paradigm built with their options, else the
    name as Lightning takes it (ddp, ...)."""
    options = {"solver": a.solver, "averaging": a.averaging, **strategy_options(a.option)}
    strategy: object = a.strategy
    if a.strategy == "oscars":
        strategy = OscarsStrategy(**options)
    elif a.strategy in PARADIGMS:  # a parameter-server paradigm with its own options (staleness=15, ...)
        strategy = PARADIGMS[a.strategy][0](**strategy_options(a.option))
    return strategy


def _trainer(a: argparse.Namespace, strategy: object) -> L.Trainer:
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=a.devices,
        num_nodes=a.num_nodes,
        max_epochs=a.epochs,
        val_check_interval=a.val_check_interval,
        logger=False,
        enable_checkpointing=False,
        # A terminal gets Lightning's progress bar; a log or a pipe one line per epoch.
        enable_progress_bar=a.progress and sys.stdout.isatty(),
        callbacks=[EpochLines()] if a.progress and not sys.stdout.isatty() else None,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _run_name(a: argparse.Namespace) -> str:
    """The run's name in the reports: the strategy, with the options that make it differ from its defaults."""
    name = a.strategy if a.strategy != "oscars" else f"oscars-{a.solver}-{a.averaging}"
    if a.strategy in PARADIGMS and a.option:
        name += "-" + ",".join(a.option)
    if a.momentum != 0.9:
        name += f"-momentum={a.momentum:g}"
    return name


def _result(a: argparse.Namespace, trainer: L.Trainer, model: BenchModule, wall: float) -> dict:
    """Rank 0's JSON summary of the run."""
    s = trainer.strategy
    history = [r.as_dict() for r in getattr(s, "history", [])]
    allreduce = [r["allreduce_time"] for r in history[1:]]
    return {
        "strategy": _run_name(a),
        "slowdown": a.slowdown,
        "epochs": a.epochs,
        "wall_s": wall,
        "val_acc": model.val_curve[-1][2],
        "val_loss": model.val_curve[-1][1],
        "curve": model.val_curve,
        "schedule": list(s.schedule.local_steps) if getattr(s, "schedule", None) else None,
        "step_time_s": history[-1]["step_times"] if history else None,
        "allreduce_s": sorted(allreduce)[len(allreduce) // 2] if allreduce else None,
        "cluster": model.cluster,
        "per_sample_ms": a.per_sample_ms,
        "batch_size": model.hparams.batch_size,
        "memory": _memory(trainer),
        # balance="batch": the shares of the last global batch, and how often they changed
        "shares": _shares(s),
        "history": history,
        # the strategy's own end-of-fit figure, for comparison with the benchmark's (same definition)
        "monitor_fraction_of_ideal": run_fraction_of_ideal(s.history) if history else None,
        **summarize(model, history, model.hparams.batch_size),
        # a parameter server's figures on rank 0's shard: staleness of every grant, replies held back
        "server": s.scheme.report if isinstance(s, ParameterServerStrategy) else None,
        # ripples: groups performed, mean group size, seconds in groups on rank 0; how often each pair met
        "groups": s.scheme.report if isinstance(s, RipplesStrategy) else None,
    }


def _memory(trainer: L.Trainer) -> dict:
    """What rank 0 holds of the model: parameter, gradient (one per trainable parameter during a step) and optimizer
    state bytes (a sharded replica's rank: its shards), and the process's peak resident memory."""

    def held(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.numel() * local.element_size()

    module = trainer.lightning_module
    states = [t for o in trainer.optimizers for s in o.state.values() for t in s.values()]
    return {
        "parameter_bytes": sum(held(p) for p in module.parameters()),
        "gradient_bytes": sum(held(p) for p in module.parameters() if p.requires_grad),
        "optimizer_state_bytes": sum(held(t) for t in states if isinstance(t, torch.Tensor) and t.dim() > 0),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _shares(strategy: object) -> dict | None:
    session = getattr(strategy, "batch_session", None)
    if session is None:
        return None
    full = [step for step in session.steps if sum(step) == session.schedule.total] or session.steps
    return {"last": full[-1] if full else None, "changes": len(session.changes) - 1}


def main() -> None:
    _stacks_on_sigusr2()
    a = _parser().parse_args()
    L.seed_everything(a.seed, verbose=False)
    model = BenchModule(
        slowdown=a.slowdown,
        step_ms=a.step_ms,
        per_sample_ms=a.per_sample_ms,
        hidden=a.hidden,
        n_train=a.n_train,
        jitter=a.jitter,
        ballast_mb=a.ballast_mb,
        momentum=a.momentum,
        lr=a.lr,
        batch_size=a.batch_size,
        task=a.task,
    )
    trainer = _trainer(a, _strategy(a))
    start = time.perf_counter()
    trainer.fit(model)
    wall = time.perf_counter() - start
    if trainer.global_rank == 0:
        result = _result(a, trainer, model, wall)
        with open(a.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
