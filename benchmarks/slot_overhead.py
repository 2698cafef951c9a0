"""Per-slot cost of the strategy itself, beyond the user's step: oscars against Lightning's plain ddp.

    python -m benchmarks.slot_overhead --out benchmarks/results
    PYTHONPATH=/path/to/other/checkout python -m benchmarks.slot_overhead --out /tmp/x   # measure other code

Setup: 2 CPU ranks (gloo, Lightning's own popen launcher, ``torch.set_num_threads(1)`` per rank), a tiny model
(``Linear(32, 10)``, batch 32, plain SGD, no logging, no validation, no progress bar, no checkpoints), ``max_steps``
slots of one epoch. oscars runs with ``OscarsStrategy(local_steps=[8, 2], monitor=False)``: rounds of 8 slots,
rank 0 trains in all 8, rank 1 in the first 2 and does 6 no-op slots. ddp runs the same model and data.

A callback timestamps every ``on_train_batch_start`` and records ``trainer.strategy.slot_is_real`` (always real
under ddp); the module times its ``training_step`` (forward + loss) and its ``optimizer_step`` call (training_step,
zero_grad, backward and SGD step: all of a real step's compute; under ddp also the gradient all-reduce). Slot ``i``
lasts from its ``on_train_batch_start`` to slot ``i + 1``'s: its step, its ``on_train_batch_end`` hooks,
Lightning's work between batches and fetching + moving the next batch. Counted: a *real* slot followed by a real
one (so the interval holds one batch fetch, as under ddp), a *no-op* slot followed by a no-op one. Left out: the
first ``--warmup`` slots and every slot that ends a round (its ``on_train_batch_end`` holds the averaging
all-reduce and the wait for the other rank; round starts are read from the real/no-op pattern).

Per rank and run: medians of the slot, of training_step, of optimizer_step, and slot minus each (the overhead of
the strategy + Lightning per real slot), and the median no-op slot. Reported: the median over ``--repeats`` runs
(strategies interleaved). Every rank records the ``lightning_oscars`` it imported (PYTHONPATH wins: the ranks run
this file as a script, so the current directory is not put first on ``sys.path``). Writes slot_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LOCAL_STEPS = [8, 2]
ROOT = Path(__file__).resolve().parents[1]
Row = list[Any]  # [batch_idx, perf_counter at on_train_batch_start, real, training_step s, optimizer_step s]


def job(strategy_name: str, slots: int, out: Path) -> None:
    """One 2-rank fit; runs in every rank (the launcher re-runs this file). Each rank writes rank{r}.json."""
    import torch

    torch.set_num_threads(1)
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader

    import lightning_oscars
    from benchmarks.task import make_dataset

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(32, 10)
            self.rows: list[Row] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            start = time.perf_counter()
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.rows[-1][3] = time.perf_counter() - start
            return loss

        def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            super().optimizer_step(*args, **kwargs)
            self.rows[-1][4] = time.perf_counter() - start

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(make_dataset(2 * 32 * slots, seed=0), batch_size=32, shuffle=True)

    class SlotClock(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            pl_module.rows.append([batch_idx, time.perf_counter(), getattr(trainer.strategy, "slot_is_real", True)])
            pl_module.rows[-1] += [None, None]

        def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
            mine = {"rank": trainer.global_rank, "lightning_oscars": lightning_oscars.__file__, "rows": pl_module.rows}
            (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(mine))

    L.seed_everything(0, verbose=False)
    trainer = _trainer(strategy_name, slots, SlotClock())
    trainer.fit(Tiny())


def _trainer(strategy_name: str, slots: int, clock: Any) -> Any:
    """Both strategies' trainer: 2 CPU ranks, one epoch of ``slots`` slots, nothing around the steps (no logging,
    checkpoints, progress bar, summary or sanity validation) but ``clock``."""
    import lightning as L

    import lightning_oscars

    oscars = strategy_name == "oscars"
    return L.Trainer(
        strategy=lightning_oscars.OscarsStrategy(local_steps=LOCAL_STEPS, monitor=False) if oscars else strategy_name,
        accelerator="cpu",
        devices=2,
        max_steps=slots,
        max_epochs=1,
        callbacks=[clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _ms(values: list[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None


def rank_figures(rows: list[Row], round_starts: set[int], warmup: int) -> dict[str, Any]:
    real: list[float] = []
    noop: list[float] = []
    steps: list[float] = []
    opts: list[float] = []
    for a, b in zip(rows, rows[1:]):
        if a[0] < warmup or b[0] != a[0] + 1 or b[0] in round_starts:
            continue
        if a[2] and b[2]:
            real.append(b[1] - a[1])
            steps.append(a[3])
            opts.append(a[4])
        elif not a[2] and not b[2]:
            noop.append(b[1] - a[1])
    f: dict[str, Any] = {"real_slot_ms": _ms(real), "step_ms": _ms(steps), "opt_step_ms": _ms(opts)}
    f["noop_slot_ms"] = _ms(noop)
    f["real_minus_step_ms"] = None if not real else f["real_slot_ms"] - f["step_ms"]
    f["real_minus_opt_ms"] = None if not real else f["real_slot_ms"] - f["opt_step_ms"]
    f["n_real"], f["n_noop"] = len(real), len(noop)
    return f


def run(strategy: str, slots: int, warmup: int) -> dict[str, Any]:
    """One fit in a fresh process group (the environment's PYTHONPATH comes first, then the repository)."""
    with tempfile.TemporaryDirectory() as tmp:
        leaked = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")
        env = {k: v for k, v in os.environ.items() if k not in leaked}
        env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--job", strategy, "--slots", str(slots), "--out", tmp]
        start = time.perf_counter()
        done = subprocess.run(cmd, timeout=600, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if done.returncode:
            sys.exit(f"{strategy} run failed (exit {done.returncode}):\n{done.stderr.decode()[-4000:]}")
        wall = time.perf_counter() - start
        load = os.getloadavg()[0]  # 1-minute load average at the end of the run: other work on the machine
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]  # also: which code
    patterns = [{row[0]: row[2] for row in r["rows"]} for r in ranks]
    round_starts = {i for p in patterns for i, real in p.items() if real and p.get(i - 1) is False}
    figures = [rank_figures(r["rows"], round_starts, warmup) for r in ranks]
    return {
        "process_wall_s": wall,
        "load": load,
        "ranks": figures,
        "lightning_oscars": [r["lightning_oscars"] for r in ranks],
    }


KEYS = ("real_slot_ms", "step_ms", "real_minus_step_ms", "opt_step_ms", "real_minus_opt_ms", "noop_slot_ms")


def median_of(runs: list[dict[str, Any]], rank: int, key: str) -> float | None:
    values = [r["ranks"][rank][key] for r in runs if r["ranks"][rank][key] is not None]
    return statistics.median(values) if values else None


def main() -> None:
    from benchmarks.tables import markdown_table  # here: the ranks run this file as a script

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slots", type=int, default=2048, help="slots (batches) per fit and rank")
    p.add_argument("--warmup", type=int, default=64, help="first slots left out")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--job", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.job:
        return job(a.job, a.slots, Path(a.out))
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {"oscars": [], "ddp": []}
    for i in range(a.repeats):
        for name, rs in runs.items():  # interleaved, so drifts of the machine hit both alike
            rs.append(run(name, a.slots, a.warmup))
            r = rs[-1]
            figs = "  ".join(
                f"rank {k} real {f['real_slot_ms']:.3f} no-op {f['noop_slot_ms']}" for k, f in enumerate(r["ranks"])
            )
            print(
                f"[{i + 1}/{a.repeats}] {name:6s} {r['process_wall_s']:5.1f}s load {r['load']:.1f}  {figs}", flush=True
            )
    code = sorted({path for rs in runs.values() for r in rs for path in r["lightning_oscars"]})
    summary = {n: [{k: median_of(rs, rank, k) for k in KEYS} for rank in range(2)] for n, rs in runs.items()}
    meta = {"repeats": a.repeats, "slots": a.slots, "warmup": a.warmup, "local_steps": LOCAL_STEPS, "ranks": 2}
    meta.update(lightning_oscars=code, wall_s=time.perf_counter() - started)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "slot_overhead.json").write_text(json.dumps({"meta": meta, "median": summary, "runs": runs}, indent=1))
    lines = [
        f"2 CPU ranks, Linear(32, 10), batch 32, {a.slots} slots per fit ({a.warmup} left out), oscars "
        f"local_steps={LOCAL_STEPS}, medians (ms) of {a.repeats} runs; lightning_oscars from {', '.join(code)}.",
        "",
    ]
    headers = ["strategy", "rank", "real slot", "training_step", "slot - training_step", "optimizer_step"]
    headers += ["slot - optimizer_step", "no-op slot"]
    rows = [
        [name, rank, *("-" if f[k] is None else f"{f[k]:.3f}" for k in KEYS)]
        for name, per_rank in summary.items()
        for rank, f in enumerate(per_rank)
    ]
    lines += markdown_table(headers, rows, align="lrrrrrrr")
    counts = "; ".join(
        f"{n} rank {k}: {f['n_real']}/{f['n_noop']}" for n, rs in runs.items() for k, f in enumerate(rs[0]["ranks"])
    )
    loads = ", ".join(f"{r['load']:.1f}" for rs in runs.values() for r in rs)
    lines += ["", f"Intervals counted per run (real/no-op): {counts}.", f"1-min load average after each run: {loads}."]
    (out / "slot_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wall {meta['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
