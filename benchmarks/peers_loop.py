"""One rank of a plain-loop peer of ``benchmarks.peers``, run as ``python -m benchmarks.peers --worker``: the peer's
averaging set up as its documentation shows it (torchft's ``LocalSGD`` or ``DiLoCo`` with the rank as its own
replica group, torch's ``PeriodicModelAverager`` or ``DistributedDataParallel`` on a gloo group), the training loop
with validation off the training clock, and the rank's accounting written to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["train_rank"]


@dataclass
class PeerSync:
    """How this rank's peer averages: torchft's manager and its wrapper, or torch's averager; none of them under
    DDP, whose all-reduce runs inside ``backward``."""

    manager: Any = None
    wrapper: Any = None
    averager: Any = None
    store: Any = None  # the TCPStore torchft's manager connects to: held here so it lives as long as the run


def train_rank(a: argparse.Namespace) -> None:
    """One rank of a plain-loop peer; writes its accounting to ``a.out``."""
    torch.set_num_threads(1)
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

    if a.algo.startswith("torchft"):
        sync = _join_torchft(a, model, optimizer)
    else:
        model, sync = _join_gloo_group(a, model)
    result = _train(a, model, optimizer, sampler, loader, device, sync, (val_x, val_y))
    Path(a.out).write_text(json.dumps(result))
    if sync.manager is not None:
        sync.manager.shutdown(wait=False)
    elif torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _join_torchft(a: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer) -> PeerSync:
    """torchft's ``LocalSGD`` or ``DiLoCo`` around the model, the rank its own replica group, the first quorum
    joined."""
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
        wrapper = DiLoCo(manager, [model], optimizer, outer, sync_every=a.sync_every, backup_device=torch.device("cpu"))
    # Join the first quorum (which configures the replicas' process group) before the clock starts, as
    # Lightning's process group is set up before its training clock starts.
    manager.start_quorum()
    manager.wait_quorum()
    return PeerSync(manager=manager, wrapper=wrapper, store=store)


def _join_gloo_group(a: argparse.Namespace, model: nn.Module) -> tuple[nn.Module, PeerSync]:
    """A gloo process group of every rank; torch's averager, or the model wrapped in ``DistributedDataParallel``."""
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
        return model, PeerSync(averager=PeriodicModelAverager(period=a.sync_every, warmup_steps=a.sync_every - 1))
    return nn.parallel.DistributedDataParallel(model), PeerSync()


def _accuracy(model: nn.Module, val_x: torch.Tensor, val_y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        acc = sum((model(x).argmax(-1) == y).sum().item() for x, y in zip(val_x.split(512), val_y.split(512))) / len(
            val_y
        )
    model.train()
    return acc


def _step_and_average(optimizer: torch.optim.Optimizer, model: nn.Module, sync: PeerSync, before: int) -> bool:
    """The optimizer step and the peer's averaging after it; whether this step averaged (``before``: torchft's step
    count before it)."""
    optimizer.step()  # torchft averages in its post-step hook
    averager = sync.averager
    if averager is not None:
        synced = averager.step >= averager.warmup_steps and (
            (averager.step - averager.warmup_steps) % averager.period == 0
        )
        averager.average_parameters(model.parameters())
        return synced
    return sync.manager is not None and sync.manager.current_step() != before


def _train(
    a: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: Any,
    loader: Any,
    device: Any,
    sync: PeerSync,
    val: tuple[torch.Tensor, torch.Tensor],
) -> dict[str, Any]:
    """``a.epochs`` epochs of the plain loop, validating every ``a.val_check_interval`` of an epoch (paused off the
    training clock); the rank's accounting."""
    steps_per_epoch = len(loader)
    check_every = max(1, round(a.val_check_interval * steps_per_epoch))
    curve: list[tuple[float, float, float]] = []
    syncs, sync_s, paused = 0, 0.0, 0.0
    if sync.wrapper is not None:
        sync.wrapper.__enter__()
    start = time.perf_counter()
    try:
        for epoch in range(a.epochs):
            sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                device.step(time.perf_counter() - start - paused)
                before = sync.manager.current_step() if sync.manager is not None else 0
                t0 = time.perf_counter()
                if _step_and_average(optimizer, model, sync, before):
                    syncs += 1
                    sync_s += time.perf_counter() - t0
                if (i + 1) % check_every == 0 or i + 1 == steps_per_epoch:
                    t_val = time.perf_counter()
                    clock = t_val - start - paused  # training seconds so far, validation excluded
                    curve.append((clock, float("nan"), _accuracy(model, *val)))
                    paused += time.perf_counter() - t_val
    finally:
        if sync.wrapper is not None:
            sync.wrapper.__exit__(None, None, None)
    wall = time.perf_counter() - start - paused
    return {
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
