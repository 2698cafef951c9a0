"""``batch_sizes="auto"``: the largest batch each rank's device fits, found by a probe at fit start.

On CUDA, each rank runs the user's ``training_step`` and its backward on batches built from the training set at a
few sizes (the user's ``batch_size`` and half of it), reads the allocator's peak for each, fits
``core/memory_fit.MemoryModel`` and takes the largest batch within the device's memory less a margin, reserving
what the optimizer's state will take at its first step (Adam's two moments, unless the optimizer says less). The probe
leaves no trace: the parameters are not stepped, their gradients are dropped, BatchNorm's running statistics and
the random generators are put back, and ``self.log`` does nothing meanwhile. One all-gather tells every rank every
rank's answer. Elsewhere (CPU), ``"auto"`` means the user's ``batch_size`` on every rank.

The probe needs what a plain ``training_step`` call can run: automatic optimisation, and a map-style dataset whose
samples the DataLoader's ``collate_fn`` batches. Otherwise it warns and keeps the user's ``batch_size``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_oscars.core.memory_fit import MemoryModel, scaled_batch_sizes
from lightning_oscars.lightning import _internals as internals

__all__ = [
    "CudaMemoryGauge",
    "MemoryGauge",
    "auto_batch_fits",
    "auto_rank_batch_sizes",
    "probe_largest_batch",
    "probe_problem",
]

DEFAULT_MARGIN = 0.1  # of the device's memory, kept free: fragmentation, longer samples, the next step's temporaries
# The optimizer's state per parameter byte at its first step, by optimizer class (others: 2, Adam's, to be safe).
STATE_PER_PARAMETER_BYTE = {"SGD": 1.0, "Adagrad": 1.0, "RMSprop": 1.0, "Adam": 2.0, "AdamW": 2.0, "Adamax": 2.0}


class MemoryGauge(Protocol):
    """Where a probe reads memory: the peak bytes of what ran inside :meth:`measure`, and what the process may use."""

    def measure(self) -> AbstractContextManager[None]: ...

    def peak(self) -> int: ...

    def capacity(self) -> int: ...


class CudaMemoryGauge:
    """The CUDA caching allocator's peak, and the device's free memory plus what this process already holds."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @contextmanager
    def measure(self) -> Iterator[None]:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        torch.cuda.synchronize(self.device)

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def capacity(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free + torch.cuda.memory_reserved(self.device))


def _is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def _sample_batch(dataloader: DataLoader, n: int) -> Any:
    dataset: Any = dataloader.dataset
    items = [dataset[i % len(dataset)] for i in range(n)]
    return dataloader.collate_fn(items)  # type: ignore[misc]


def _reserved_optimizer_bytes(module: LightningModule, optimizers: list[torch.optim.Optimizer]) -> float:
    trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    if not optimizers:
        return 2.0 * trainable
    if any(o.state for o in optimizers):  # resumed: the state is allocated already, and in the peaks
        return 0.0
    ratio = max(STATE_PER_PARAMETER_BYTE.get(type(o).__name__, 2.0) for o in optimizers)
    if all(type(o).__name__ == "SGD" and not o.defaults.get("momentum") for o in optimizers):
        ratio = 0.0
    return ratio * trainable


def _step_peak(module: LightningModule, batch: Any, gauge: MemoryGauge, context: Any) -> int:
    """Bytes at the peak of one forward and backward of ``batch`` (nothing stepped; gradients dropped after)."""
    with gauge.measure():
        with context():
            output = module.training_step(batch, 0)
        loss = output["loss"] if isinstance(output, dict) else output
        if not isinstance(loss, torch.Tensor):
            raise TypeError("training_step returned no loss")
        loss.backward()
        del output, loss
    peak = gauge.peak()
    for parameter in module.parameters():
        parameter.grad = None
    return peak


@contextmanager
def _leaving_no_trace(module: LightningModule) -> Iterator[None]:
    """Buffers (BatchNorm's running statistics), train/eval modes, random generators and ``self.log`` as they were."""
    buffers = [b.detach().clone() for b in module.buffers()]
    modes = [m.training for m in module.modules()]
    rng = internals.rng_states()
    logging = {name: vars(module).get(name) for name in ("log", "log_dict")}
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, before in logging.items():
            if before is None:
                delattr(module, name)
            else:
                setattr(module, name, before)
        with torch.no_grad():
            for buffer, saved in zip(module.buffers(), buffers):
                buffer.copy_(saved)
        internals.restore_rng_states(rng)
        for submodule, training in zip(module.modules(), modes):
            submodule.training = training
        for parameter in module.parameters():
            parameter.grad = None


def probe_largest_batch(
    module: LightningModule,
    dataloader: DataLoader,
    gauge: MemoryGauge,
    *,
    to_device: Any = lambda batch: batch,
    context: Any = None,
    optimizers: list[torch.optim.Optimizer] | None = None,
    margin: float = DEFAULT_MARGIN,
) -> int:
    """The largest batch of ``dataloader``'s samples whose training step fits ``gauge``'s device (see the module
    docstring); ``to_device`` moves a batch, ``context`` is the precision's step context (autocast)."""
    step_context = context if context is not None else _no_context
    batch_size = int(dataloader.batch_size or 1)
    sizes = sorted({max(1, batch_size // 2), max(2, batch_size)})
    points: list[tuple[int, float]] = []
    with _leaving_no_trace(module):
        module.train()
        for n in sizes:
            try:
                points.append(
                    (n, float(_step_peak(module, to_device(_sample_batch(dataloader, n)), gauge, step_context)))
                )
            except RuntimeError as error:
                if not _is_out_of_memory(error):
                    raise
                torch.cuda.empty_cache()
                break
    if not points:
        raise RuntimeError(f"batch_sizes='auto': a batch of {sizes[0]} samples does not fit this device's memory")
    if len(points) == 1:  # the larger probe did not fit: stay at the one that did
        return points[0][0]
    reserved = _reserved_optimizer_bytes(module, optimizers or [])
    fits = MemoryModel.fit(points).largest_batch(gauge.capacity(), reserved, margin)
    if fits < 1:
        raise RuntimeError("batch_sizes='auto': not one sample fits this device's memory beside the optimizer state")
    return fits


@contextmanager
def _no_context() -> Iterator[None]:
    yield


def probe_problem(module: LightningModule, dataloader: object) -> str | None:
    """Why the probe cannot run on this module and loader (the same answer on every rank), or ``None``."""
    if not module.automatic_optimization:
        return "manual optimization steps the optimizer inside training_step"
    if not isinstance(dataloader, DataLoader) or not hasattr(dataloader.dataset, "__len__"):
        return "the training set is not a map-style dataset of a torch DataLoader"
    if any(isinstance(p, DTensor) for p in module.parameters()):
        # A sharded forward gathers inside the replica: a rank running out of memory at a size its partner does
        # not would leave the partner waiting in the next gather.
        return "the model is sharded (shard_replicas), and a probe's collectives could not stay matched"
    return None


def auto_batch_fits(strategy: ParallelStrategy, dataloader: object) -> list[int] | None:
    """Every rank's largest batch (one all-gather, on every rank), or ``None`` off CUDA and where the probe cannot
    run (a warning says why): the user's ``batch_size`` everywhere."""
    device = strategy.root_device
    module = strategy.lightning_module
    if device.type != "cuda" or module is None:
        return None
    problem = probe_problem(module, dataloader)
    fit = 0
    if problem is None:
        assert isinstance(dataloader, DataLoader)
        strategy.model_to_device()
        try:
            fit = probe_largest_batch(
                module,
                dataloader,
                CudaMemoryGauge(device),
                to_device=lambda batch: move_data_to_device(batch, device),
                context=strategy.precision_plugin.train_step_context,
                optimizers=list(strategy.optimizers),
            )
        except Exception as error:  # noqa: BLE001 - every rank must reach the all-gather below, or the others hang
            problem = f"the probe failed on rank {strategy.global_rank}: {type(error).__name__}: {error}"
            rank_zero_warn(f"oscars: batch_sizes='auto': {problem}", rank_zero_only=False)
    fits: list[Any] = [None] * strategy.world_size
    torch.distributed.all_gather_object(fits, fit)
    if problem is not None or 0 in fits:
        rank_zero_warn(f"oscars: batch_sizes='auto' keeps the DataLoader's batch_size: {problem or 'no probe ran'}.")
        return None
    rank_zero_info(f"oscars: batch_sizes='auto': the largest batch each rank fits: {fits}")
    return [int(f) for f in fits]


def auto_rank_batch_sizes(strategy: ParallelStrategy, trainer: Trainer) -> list[int] | None:
    """``batch_sizes="auto"`` under local steps: every rank's batch size from what each fits
    (``core/memory_fit.scaled_batch_sizes``: the user's ``batch_size`` on the rank that fits least, others in
    proportion), or ``None`` (the user's ``batch_size`` everywhere) off CUDA or where the probe cannot run."""
    if strategy.root_device.type != "cuda":
        return None
    loader = internals.first_training_dataloader(trainer)
    fits = auto_batch_fits(strategy, loader)
    if fits is None or not isinstance(loader, DataLoader) or loader.batch_size is None:
        return None
    return scaled_batch_sizes(fits, int(loader.batch_size))
