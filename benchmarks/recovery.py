"""What a lost rank costs: oscars' recovery against restarting from the last checkpoint, and an undisturbed run.

    python -m benchmarks.recovery [--runs 3] [--kill-step 90] [--regime gpu-like|cpu] [--launcher lightning|torchrun]
        [--strategy oscars|bsp|asp|ssp|dssp|dasp|ripples] [--name recovery]

Two ranks through Lightning's launcher (rank 1 3x slower on scikit-learn's digits, 6 epochs; GPU-like: every step
mostly a 60 ms sleep; cpu: the CNN's real compute, rank 1's slowdown a sleep of twice its measured step). Rank 1
is SIGKILLed at global step ``--kill-step`` (mid-way through the third epoch; 5 steps later in each further run, so
that it dies at another point of its round), and a loop restarts the job at once:

* ``undisturbed``: no failure;
* ``recovery, node back``: the restart has two ranks again (the second starts from a copy of the survivor's state);
* ``recovery, one rank left``: the restart has only the survivor;
* ``last checkpoint``: today's alternative: ``ModelCheckpoint(save_last=True)`` at every epoch end, ``recovery=False``,
  the restart given ``ckpt_path="last"``.

``--launcher torchrun``: the same job under torch's elastic agent, two agents on loopback (``--nnodes=1:2``, one rank
each, ``--max-restarts=3``); node 1 (agent and rank) is SIGKILLed; "node back" starts a new agent for it as soon as it
died, "one rank left" does not, and the surviving agent restarts its rank either way.

Per scenario, medians of ``--runs``: the wall time of the whole job (every launch, start-up included), the seconds
from the kill to the restarted fit's first training step, the samples trained again (all samples trained minus
epochs x the training set), and the final test accuracy. Writes benchmarks/results/NAME.{json,md}.
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

from benchmarks.ports import free_port, wait_until_listening

RESULTS = Path(__file__).resolve().parent / "results"
TRAIN_SAMPLES = 1438  # len(benchmarks.task.load_digits_split()[0]): the digits less the held-out test images
EPOCHS = 6
SCENARIOS = {
    "undisturbed": ("none", [2]),
    "recovery, node back": ("recovery", [2, 2]),
    "recovery, one rank left": ("recovery", [2, 1]),
    "last checkpoint": ("checkpoint", [2, 2]),
}


STEP_MS = {"gpu-like": 60.0, "cpu": 0.0}


def _launch(out: Path, job: list[str], devices: int) -> float:
    cmd = [sys.executable, *job, "--devices", str(devices)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    with open(out / "launches.log", "a") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=600, check=False)
    return time.perf_counter() - started


def _job(out: Path, mode: str, seed: int, regime: str, strategy: str, kill_step: int | None = None) -> list[str]:
    job = ["-m", "benchmarks.recovery_job", "--out", str(out), "--mode", mode, "--epochs", str(EPOCHS)]
    job += ["--seed", str(seed), "--step-ms", str(STEP_MS[regime]), "--strategy", strategy]
    return job + (["--kill-step", str(kill_step)] if kill_step is not None else [])


def _launch_agents(job: list[str], kill_step: int | None, out: Path, node_back: bool) -> float:
    """The job under torch's elastic agent: two agents on loopback (``--nnodes=1:2``, one rank each, restarts
    allowed); node 1 (its agent and rank) is SIGKILLed at ``kill_step``; ``node_back``: a new agent for node 1 is
    started as soon as it died. Returns the wall time until the first agent (the rendezvous host) exits."""
    port = free_port()
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3"]
    agent += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-conf=last_call_timeout=2"]
    agent += ["--monitor-interval=1"]
    # torch's shared rendezvous store keeps a restarted round waiting for the last round's keys (pytorch#135712)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    started = time.perf_counter()
    with open(out / "launches.log", "a") as log:
        host = subprocess.Popen([*agent, *job], stdout=log, stderr=log, env=env)
        wait_until_listening(port, host)  # the first agent hosts the rendezvous store: it must survive
        killed = job + ([] if kill_step is None else ["--kill-step", str(kill_step)])
        nodes = [subprocess.Popen([*agent, *killed], stdout=log, stderr=log, env=env)]
        try:
            while host.poll() is None and node_back and not (out / "killed.json").exists():
                time.sleep(0.2)
            if host.poll() is None and node_back:
                nodes[0].wait(timeout=60)
                nodes.append(subprocess.Popen([*agent, *job], stdout=log, stderr=log, env=env))
            host.wait(timeout=900)
        finally:
            for p in [host, *nodes]:
                if p.poll() is None:
                    p.kill()
    return time.perf_counter() - started


def run_scenario(
    mode: str,
    launches: list[int],
    kill_step: int,
    seed: int,
    regime: str = "gpu-like",
    launcher: str = "lightning",
    strategy: str = "oscars",
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        wall = 0.0
        job = _job(out, mode, seed, regime, strategy)
        kill = kill_step if len(launches) > 1 else None
        if launcher == "torchrun":
            wall = _launch_agents(job, kill, out, node_back=launches[-1] == 2 and kill is not None)
        for k, devices in enumerate(launches if launcher == "lightning" else []):
            wall += _launch(out, _job(out, mode, seed, regime, strategy, kill if k == 0 else None), devices)
        if not (out / "result.json").exists():
            raise RuntimeError(
                f"{mode} {launches}: the job did not finish\n{(out / 'launches.log').read_text()[-3000:]}"
            )
        result = json.loads((out / "result.json").read_text())
        trained = sum(
            json.loads(line)["samples"] for path in out.glob("steps-*.jsonl") for line in path.read_text().splitlines()
        )
        back = None
        if (out / "killed.json").exists():
            killed = json.loads((out / "killed.json").read_text())["time"]
            starts = [json.loads(p.read_text())["time"] for p in out.glob("started-*.json")]
            back = min(t for t in starts if t > killed) - killed
        return {
            "wall_s": wall,
            "back_to_training_s": back,
            "discarded": trained - EPOCHS * TRAIN_SAMPLES,
            "val_acc": result["val_acc"],
        }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kill-step", type=int, default=90)
    p.add_argument("--regime", default="gpu-like", choices=sorted(STEP_MS))
    p.add_argument("--launcher", default="lightning", choices=("lightning", "torchrun"))
    p.add_argument("--strategy", default="oscars")
    p.add_argument("--name", default="recovery")
    a = p.parse_args()
    rows: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
    for run in range(a.runs):
        for name, (mode, launches) in SCENARIOS.items():  # side by side, in turn, every run
            # The kill moves by 5 steps a run: the dead rank is caught at another point of its round each time.
            kill = a.kill_step + 5 * run
            how = {"regime": a.regime, "launcher": a.launcher, "strategy": a.strategy}
            rows[name].append(run_scenario(mode, launches, kill, seed=run, **how))
            print(name, rows[name][-1], flush=True)
    med = {
        name: {
            key: statistics.median(r[key] for r in runs if r[key] is not None) if runs[0][key] is not None else None
            for key in runs[0]
        }
        for name, runs in rows.items()
    }
    RESULTS.mkdir(exist_ok=True)
    summary = {"runs": rows, "median": med, "kill_step": a.kill_step, "regime": a.regime, "launcher": a.launcher}
    summary["strategy"] = a.strategy
    (RESULTS / f"{a.name}.json").write_text(json.dumps(summary))
    lines = [
        f"# What a lost rank costs ({a.strategy}, {a.launcher}: 2 ranks, rank 1 3x slower, {a.regime}, digits,"
        f" {EPOCHS} epochs;"
        " rank 1 SIGKILLed at"
        f" step {a.kill_step} + 5 x run; medians of {a.runs})",
        "",
        "| scenario | job wall s | kill to training again s | samples trained again | final test acc |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, m in med.items():
        back = "-" if m["back_to_training_s"] is None else f"{m['back_to_training_s']:.1f}"
        lines.append(f"| {name} | {m['wall_s']:.1f} | {back} | {m['discarded']:.0f} | {m['val_acc']:.4f} |")
    (RESULTS / f"{a.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
