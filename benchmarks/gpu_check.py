"""What one GPU can show about oscars: one prepared script, a verdict per check, under 5 minutes.

    python -m benchmarks.gpu_check              # on a machine with one CUDA GPU
    python -m benchmarks.gpu_check --cpu        # the same plumbing on the CPU (checks that need CUDA say SKIP)

Checks:
1. ``cuda-event-clock``: step times from ``CudaEventClock`` (the strategy's clock on GPU) against host wall time
   around ``torch.cuda.synchronize`` for the same steps: medians within 10%, and the event clock adds no host
   synchronisation per step (measured: the host returns before the device finishes).
2. ``cuda-averaging``: ``FlatAverager`` on CUDA tensors in 2 processes sharing the GPU over gloo: the result is
   the exact mean (float32 parameters, an int64 counter), and ranks end bit-identical; ``overlap_averaging``'s
   posted all-reduce (``LateAverage``) applied after a step of progress gives the mean plus that progress.
3. ``fit-gpu-2ranks``: ``Trainer(strategy=OscarsStrategy(process_group_backend="gloo"))`` with 2 ranks on the one
   GPU (launched as two single-GPU "nodes"), rank 1 emulated 3x slower, 2 epochs, and ``ddp`` on the same device,
   data and emulated speeds right after: oscars ends with every parameter and buffer identical on both ranks, the
   schedule favours rank 0, its step times come from CUDA events, and its second epoch's images per second are at
   least ddp's (a small MLP: the step is mostly launch overhead).
4. ``fit-bf16-resnet``: the same with ``precision="bf16-mixed"`` and a torchvision ResNet-18 on 32x32 images, where
   oscars must train at least 1.2x ddp's images per second.
5. ``cifar10-example``: the figures a GPU user can expect from ``examples/cifar10_resnet.py`` (the paper's
   setting) on this GPU, on CIFAR-shaped synthetic data (offline), batch 128, ``bf16-mixed``, one device, for
   ResNet-18 and ResNet-101 with the CIFAR stem: the median step on the device (synchronised before and after) and
   the median wait for the next batch (the loader's PIL transforms), after the first 20 steps, timed by a callback
   inside the fit (``benchmarks.step_timer.StepTimer``) so that process start-up and validation stay out of the figures.
   (``--cpu``: ResNet-18 only, fp32, 24 steps of which the last 4 are timed: the plumbing.)
6. ``auto-batch-size``: ``batch_sizes="auto"``'s probe on the GPU (``benchmarks/gpu_memory_check.py``): the largest
   batch it finds for a ResNet-18 (bf16, Adam), and one real step at that batch fits within the device's memory.

Not testable on one GPU: NCCL (it needs one GPU per rank; two ranks on one GPU over NCCL are refused), so the
NCCL all-reduce of the averaging buffer, NCCL timeouts and multi-GPU placement stay untested until a machine
with at least two GPUs runs the test suite with ``--gpus``. Writes the verdicts as JSON to ``--out``.
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

from benchmarks.gpu_memory_check import check_auto_batch
from benchmarks.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def _pythonpath() -> str:
    """The project first, then the caller's own PYTHONPATH (packages installed with --target live there)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def check_event_clock(device: str) -> dict:
    import torch

    from lightning_oscars.core.timing import make_clock

    if not device.startswith("cuda"):
        return {"verdict": "SKIP", "why": "needs CUDA"}
    dev = torch.device(device)
    x = torch.randn(2048, 2048, device=dev)
    clock = make_clock(dev)
    walls, returns = [], []
    for _ in range(3):
        (x @ x).sum().item()  # warm-up
    for _ in range(20):
        torch.cuda.synchronize(dev)
        start = time.perf_counter()
        clock.mark()
        for _ in range(8):
            y = x @ x
        clock.lap()
        returns.append(time.perf_counter() - start)  # host time until the launches returned
        torch.cuda.synchronize(dev)
        walls.append(time.perf_counter() - start)
        del y
    events = clock.drain()
    wall, event, host = statistics.median(walls), statistics.median(events), statistics.median(returns)
    close = abs(event - wall) / wall < 0.10
    asynchronous = host < 0.5 * wall
    return {
        "verdict": "PASS" if close and asynchronous else "FAIL",
        "event_ms": 1e3 * event,
        "wall_ms": 1e3 * wall,
        "host_return_ms": 1e3 * host,
    }


def _averaging_worker(rank: int, device: str, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from lightning_oscars.dist.averaging import FlatAverager
    from lightning_oscars.dist.overlap import LateAverage

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dev = torch.device(device)
    weight = torch.full((1000,), float(rank + 1), device=dev)  # ranks hold 1 and 2: the mean is 1.5
    counter = torch.tensor([10 + rank], dtype=torch.int64, device=dev)  # 10 and 11: rounded mean 11
    averager = FlatAverager([weight, counter], control_size=1, device=dev)
    summed = averager.all_reduce(1.0, [1.0], 0)
    ok = bool(torch.all(weight == 1.5)) and int(counter) == 11 and summed == [2.0]
    # overlap_averaging's path: posted, a step of progress while in flight, then applied as mean - sent
    late_weight = torch.full((1000,), float(rank + 1), device=dev)
    late = LateAverage([late_weight], dev)
    late.post(1.0)
    late_weight.add_(0.25 * (rank + 1))
    late.apply()
    late_ok = bool(torch.all(late_weight == 1.5 + 0.25 * (rank + 1)))
    gathered = [torch.zeros(1000) for _ in range(2)]
    dist.all_gather(gathered, weight.cpu())
    same = torch.equal(gathered[0], gathered[1])
    result = {"ok": ok, "late_ok": late_ok, "same": same, "device": str(weight.device)}
    Path(out).with_suffix(f".{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def check_cuda_averaging(device: str) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "avg")
        mp.start_processes(_averaging_worker, args=(device, 29731, out), nprocs=2, start_method="spawn")
        ranks = [json.loads(Path(out).with_suffix(f".{r}").read_text()) for r in range(2)]
    ok = all(r["ok"] and r["late_ok"] and r["same"] for r in ranks)
    return {"verdict": "PASS" if ok else "FAIL", "ranks": ranks}


FIT_JOB = r"""
import json, sys, time, torch
torch.set_num_threads(1)
import lightning as L
from lightning.pytorch.strategies import DDPStrategy
from lightning_oscars import HeterogeneityEmulator, OscarsStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
accelerator, precision, model_name, out, samples, strategy_name = sys.argv[1:7]
L.seed_everything(0, verbose=False)
class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        if model_name == "resnet18":
            import torchvision
            self.net = torchvision.models.resnet18(num_classes=10)
        else:
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 256), nn.ReLU(), nn.Linear(256, 10))
    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        n = int(samples)
        data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
        return DataLoader(data, batch_size=32, shuffle=True)
class TrainClock(L.Callback):  # the training time of the fit's second epoch (the first compiles kernels, profiles)
    def on_train_epoch_start(self, trainer, pl_module):
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        self.started = time.perf_counter()
    def on_train_epoch_end(self, trainer, pl_module):
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        self.seconds = time.perf_counter() - self.started
model = Net()
if strategy_name == "oscars":
    strategy = OscarsStrategy(process_group_backend="gloo", monitor=False)
else:
    strategy = DDPStrategy(process_group_backend="gloo")
clock = TrainClock()
trainer = L.Trainer(accelerator=accelerator, devices=1, num_nodes=2, strategy=strategy, precision=precision,
                    max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, callbacks=[HeterogeneityEmulator({1: 3.0}), clock])
trainer.fit(model)
flat = torch.cat([t.detach().float().reshape(-1).cpu() for t in model.state_dict().values()])
gathered = strategy.all_gather(flat.to(strategy.root_device)).cpu()
result = {
    "rank": trainer.global_rank,
    "device": str(strategy.root_device),
    "identical": bool(torch.equal(gathered[0], gathered[1])),
    "epoch_s": clock.seconds,
    "images_per_s": int(samples) / clock.seconds,
}
if strategy_name == "oscars":
    result.update(
        clock=type(strategy.rounds.clock).__name__,
        local_steps=list(strategy.local_steps),
        rounds=len(strategy.history),
        step_ms=[1e3 * t for t in strategy.history[-1].step_times] if strategy.history else [],
    )
with open(out + f".{trainer.global_rank}", "w") as f:
    json.dump(result, f)
"""


def _fit_ranks(accelerator: str, precision: str, model: str, strategy: str, timeout: int, tmp: str) -> list[dict]:
    """Both ranks' results of one 2-rank fit on this machine's one device (rank 1 emulated 3x slower)."""
    script, out = Path(tmp) / "fit.py", Path(tmp) / f"{strategy}-{model}"
    script.write_text(FIT_JOB)
    # On the CPU (--cpu: the plumbing only) a quarter of the ResNet's data: a ResNet step is slow there.
    samples = "256" if accelerator == "cpu" and model == "resnet18" else "1024"
    procs, port = [], str(free_port())
    for node in range(2):  # two single-device "nodes" on this machine: both ranks use device 0
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node), LOCAL_RANK="0")
        env.update(WORLD_SIZE="2", PYTHONPATH=_pythonpath(), PYTHONWARNINGS="ignore")
        cmd = [sys.executable, str(script), accelerator, precision, model, str(out), samples, strategy]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"{strategy}: no result within {timeout} s (hang?)") from None
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{strategy}: a rank failed: {[log[-1500:] for log in logs]}")
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


def check_fit(accelerator: str, precision: str, model: str, timeout: int, min_speedup: float) -> dict:
    """oscars and ddp side by side on the same device, data and emulated speeds: oscars must end with the same weights
    (every parameter and buffer) on both ranks, favour the fast rank, time steps with the device's clock, and train
    at least ``min_speedup`` times ddp's images per second in the second epoch."""
    if model == "resnet18":
        try:
            import torchvision  # noqa: F401
        except ImportError:
            return {"verdict": "SKIP", "why": "torchvision is not installed"}
    with tempfile.TemporaryDirectory() as tmp:
        ranks = _fit_ranks(accelerator, precision, model, "oscars", timeout, tmp)
        ddp = _fit_ranks(accelerator, precision, model, "ddp", timeout, tmp)
    r0 = ranks[0]
    expected_clock = "CudaEventClock" if accelerator == "gpu" else "WallClock"
    speedup = r0["images_per_s"] / ddp[0]["images_per_s"]
    checks = {
        "identical": all(r["identical"] for r in ranks),
        "fast_rank_favoured": r0["local_steps"][0] > r0["local_steps"][1],
        "device_clock": all(r["clock"] == expected_clock for r in ranks),
        "faster_than_ddp": speedup >= min_speedup,
    }
    return {
        "verdict": "PASS" if all(checks.values()) else "FAIL",
        "checks": checks,
        "oscars_vs_ddp_images_per_s": round(speedup, 2),
        "oscars": ranks,
        "ddp_images_per_s": round(ddp[0]["images_per_s"], 1),
    }


def _example_fit(arch: str, images: int, accelerator: str, precision: str, timeout: int, tmp: str) -> dict:
    """One single-device fit of the CIFAR-10 example on ``images`` synthetic images: the steady step's figures."""
    out = str(Path(tmp) / f"{arch}.json")
    timer = {"class_path": "benchmarks.step_timer.StepTimer", "init_args": {"out": out}}
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "cifar10_resnet.py"),
        "fit",
        "--config",
        str(ROOT / "examples" / "configs" / "cifar10.yaml"),
        f"--model.arch={arch}",
        "--data.synthetic=true",
        f"--data.synthetic_train_size={images}",
        "--data.synthetic_val_size=256",
        f"--data.num_workers={min(8, os.cpu_count() or 1)}",
        f"--trainer.accelerator={accelerator}",
        "--trainer.devices=1",
        "--trainer.strategy=auto",
        f"--trainer.precision={precision}",
        "--trainer.max_epochs=1",
        "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp}",  # the checkpoints go there too
        f"--trainer.callbacks+={json.dumps(timer)}",
    ]
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{arch} on {images} images failed: {(done.stdout + done.stderr)[-1500:]}")
    return json.loads(Path(out).read_text())


def check_cifar10_example(accelerator: str, cuda: bool, timeout: int) -> dict:
    """Training figures of the example: the device's step time, and the end-to-end rate with the loader's wait."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return {"verdict": "SKIP", "why": "torchvision is not installed"}
    precision = "bf16-mixed" if cuda else "32-true"
    sizes = {"resnet18": 12_800, "resnet101": 6_400} if cuda else {"resnet18": 128 * 24}
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch, n in sizes.items():
            timed = _example_fit(arch, n, accelerator, precision, timeout, tmp)
            step, wait, batch = timed["step_ms"], timed["wait_ms"], timed["batch"]
            figures[arch] = {
                "steps_timed": timed["steps"],
                "ms_per_step_of_128": round(step * 128 / batch, 2),
                "device_images_per_s": round(1e3 * batch / step),
                "loader_wait_ms": round(wait, 2),
                "end_to_end_images_per_s": round(1e3 * batch / (step + wait)),
            }
    return {"verdict": "PASS", "precision": precision, "figures": figures}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run the plumbing on the CPU (CUDA-only checks SKIP)")
    p.add_argument("--timeout", type=int, default=120, help="seconds per 2-rank fit before it counts as a hang")
    p.add_argument("--out", default="gpu_check.json")
    a = p.parse_args()
    import torch

    cuda = torch.cuda.is_available() and not a.cpu
    device, accelerator = ("cuda:0", "gpu") if cuda else ("cpu", "cpu")
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    print(f"gpu_check on {info['device']} (torch {info['torch']})", flush=True)
    checks = {
        "cuda-event-clock": lambda: check_event_clock(device),
        "cuda-averaging": lambda: check_cuda_averaging(device),
        "fit-gpu-2ranks": lambda: check_fit(accelerator, "32-true", "mlp", a.timeout, min_speedup=1.0),
        # A CPU without native bf16 takes ~17 s per bf16 ResNet-18 step: --cpu checks the ResNet path in fp32.
        "fit-bf16-resnet": lambda: check_fit(
            accelerator, "bf16-mixed" if cuda else "32-true", "resnet18", a.timeout, min_speedup=1.2
        ),
        "cifar10-example": lambda: check_cifar10_example(accelerator, cuda, 4 * a.timeout),
        "auto-batch-size": lambda: check_auto_batch(device, cuda),
    }
    results = {}
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            result = check()
        except Exception as error:  # a verdict per check, whatever breaks
            result = {"verdict": "FAIL", "why": f"{type(error).__name__}: {error}"}
        result["seconds"] = round(time.perf_counter() - start, 1)
        results[name] = result
        print(f"{result['verdict']:5s} {name:18s} {json.dumps({k: v for k, v in result.items() if k != 'verdict'})}")
    Path(a.out).write_text(json.dumps({"info": info, "checks": results}, indent=1))
    sys.exit(1 if any(r["verdict"] == "FAIL" for r in results.values()) else 0)


if __name__ == "__main__":
    main()
