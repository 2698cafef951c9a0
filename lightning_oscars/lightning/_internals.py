"""Every read and write of Lightning's private state, named, so that a Lightning upgrade breaks one file.

Lightning 2.6 has no public hook for ranks that take different numbers of steps. The patches a fit installs
(``optimization_patch``, ``epoch_patch``, ``signal_patch``, ``tuner_patch``) say *what* they change; the private
attributes they change, and every other private read, are here: the resume position, ``received_sigterm``, the
combined loader's limits, the epoch's logged results, EMA copies of the model, the accumulation scheduler's value,
the checkpoint connector, the random generators and module state sync. The version check comes first.
"""

from __future__ import annotations

import lightning.pytorch as lightning_namespace
from packaging.version import Version

SUPPORTED_LIGHTNING = (">=2.6.0", "<2.7")


def check_lightning_version() -> None:
    """oscars relies on Lightning 2.6's loop internals: refuse any other release with the fix."""
    # This namespace's own release: lightning.pytorch's, or pytorch_lightning's in the twin (namespaces.py).
    found = Version(lightning_namespace.__version__)
    package = "lightning" if lightning_namespace.__name__ == "lightning.pytorch" else "pytorch-lightning"
    if not (Version("2.6.0") <= found < Version("2.7")):
        raise ImportError(
            f"lightning-oscars supports {package}>=2.6.0,<2.7 (it relies on that release's loop internals);"
            f" found {package}=={found}. Install a supported release: pip install '{package}>=2.6,<2.7'."
        )


check_lightning_version()

import inspect  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from lightning.fabric.plugins.environments import SLURMEnvironment  # noqa: E402
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver  # noqa: E402
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper  # noqa: E402
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states  # noqa: E402
from lightning.pytorch import LightningModule, Trainer  # noqa: E402
from lightning.pytorch.callbacks import (  # noqa: E402
    GradientAccumulationScheduler,
    ModelCheckpoint,
    Timer,
    WeightAveraging,  # noqa: E402
)
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher  # noqa: E402
from lightning.pytorch.overrides.distributed import _sync_module_states  # noqa: E402
from lightning.pytorch.trainer.states import RunningStage  # noqa: E402
from lightning.pytorch.tuner.lr_finder import _LRCallback  # noqa: E402

# A place a patch replaces: the object and the name of its attribute.
PatchPoint = tuple[object, str]

# ---------------------------------------------------------------------- what the patches replace


def sigterm_broadcast(trainer: Trainer) -> PatchPoint:
    """The training epoch loop's per-batch broadcast of SIGTERM (a collective at every batch)."""
    return trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor"


def child_process_kills() -> list[tuple[PatchPoint, Callable[[], None]]]:
    """Under Lightning's own launcher, rank 0's thread that SIGKILLs every rank when one dies: where its kill is
    made, and the kill."""
    return [
        ((thread, "_terminate_all"), thread._terminate_all)
        for thread in threading.enumerate()
        if isinstance(thread, _ChildProcessObserver)
    ]


def is_child_process_watch(owner: object) -> bool:
    return isinstance(owner, _ChildProcessObserver)


def logger_connector(trainer: Trainer) -> Any:
    """The connector that logs a step's values (its ``update_train_step_metrics`` runs after every batch)."""
    return trainer._logger_connector


def should_accumulate(epoch_loop: Any) -> bool:
    """Whether the batch in progress only accumulates gradients (no optimizer step at its end)."""
    return bool(epoch_loop._should_accumulate())


def optimizer_step(automatic: Any, batch_idx: int, closure: Callable[[], torch.Tensor]) -> None:
    """The automatic optimization loop's step (with its hooks and counters), run with ``closure`` as the loss."""
    automatic._optimizer_step(batch_idx, closure)


def is_lr_finder_callback(callback: object) -> bool:
    """The learning-rate finder's callback (it broadcasts its stop decision after every real step)."""
    return isinstance(callback, _LRCallback)


def step_timers(callbacks: list[Any]) -> list[Timer]:
    """``Timer`` callbacks that check their duration after every batch (a collective each time)."""
    return [cb for cb in callbacks if isinstance(cb, Timer) and cb._interval == "step"]


def timer_expired(timers: list[Timer]) -> bool:
    return any(t._duration is not None and t.time_elapsed(RunningStage.TRAINING) >= t._duration for t in timers)


def original_sigterm_handler(trainer: Trainer) -> Any:
    """The SIGTERM handler in place before Lightning installed its own (Lightning calls it from its handler)."""
    return trainer._signal_connector._original_handlers.get(signal.SIGTERM)


def requeue_signal(trainer: Trainer) -> int:
    """The signal on which the cluster environment requeues the job (SLURM's, SIGUSR1 by default)."""
    environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.requeue_signal is not None:
        return int(environment.requeue_signal)
    return int(signal.SIGUSR1)


# ---------------------------------------------------------------------- the epoch and its loader


def time_based_validation(trainer: Trainer) -> bool:
    """A ``val_check_interval`` given as a time (validation decided on each rank's clock)."""
    return getattr(trainer, "_val_check_time_interval", None) is not None


def lift_batch_limit(trainer: Trainer) -> None:
    """Let the epoch iterate the load-balanced loader to its end: Lightning caps the combined loader at
    ``limit_train_batches`` of its length, an upper bound under oscars; the plan holds the limit instead."""
    combined = trainer.fit_loop._combined_loader
    if combined is None or combined.limits is None:
        return
    combined.limits = None
    if combined._iterator is not None:  # the first epoch's iterator is made before any hook runs
        combined._iterator.limits = None
        fetcher = trainer.fit_loop._data_fetcher
        if fetcher is not None and fetcher.length is not None:  # it says "last batch" at the capped length
            fetcher.length = len(combined)


def size_training_epoch(trainer: Trainer, batches: int) -> None:
    """The epoch about to run has ``batches`` batches, not its loader's length at setup (a resume in another world
    lays its epoch out anew): Lightning's count, its combined loader's cap and its fetcher's "last batch" follow,
    under ``limit_train_batches`` as Lightning applies it."""
    limit = trainer.limit_train_batches
    count = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
    loop = trainer.fit_loop
    loop.max_batches = count
    combined = loop._combined_loader
    if combined is not None and combined.limits is not None:
        combined.limits = [count] * len(combined.limits)
        if combined._iterator is not None:
            combined._iterator.limits = list(combined.limits)
    fetcher = loop._data_fetcher
    if fetcher is not None and fetcher.length is not None:
        fetcher.length = count


def rewind_batch_progress(checkpoint: dict[str, Any], batch: int) -> None:
    """Make a checkpoint of this epoch resume at its batch ``batch``: Lightning's batch counters say that many done."""
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    current, total = progress["current"], progress["total"]
    done_before = total["completed"] - current["completed"]
    for counter in ("ready", "started", "processed", "completed"):
        current[counter], total[counter] = batch, done_before + batch
    progress["is_last_batch"] = False


def dataloader_preparation(trainer: Trainer) -> PatchPoint:
    """Where Lightning re-makes a loader with its distributed sampler (``_prepare_dataloader``)."""
    return trainer._data_connector, "_prepare_dataloader"


def training_loader_request(trainer: Trainer) -> PatchPoint:
    """Where the fit loop asks the user's code for its training loaders, on every rank, once per (re)load (the data
    source's ``dataloader``: ``train_dataloader`` of the module or data module, or the loaders given to ``fit``)."""
    return trainer.fit_loop._data_source, "dataloader"


def first_training_dataloader(trainer: Trainer) -> object:
    """The fit's (first) training DataLoader as the user's code returns it, before Lightning wraps it (its
    ``train_dataloader`` hook is called once more)."""
    source = trainer.fit_loop._data_source
    loaders: Any = type(source).dataloader(source)  # the hook itself, not the fit's agreed request (loader_patch.py)
    if isinstance(loaders, dict):
        loaders = next(iter(loaders.values()), None)
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if loaders else None
    return loaders


def set_device_mesh(module: LightningModule, mesh: Any) -> None:
    """What ``module.device_mesh`` returns in ``configure_model`` (as ``ModelParallelStrategy`` sets it)."""
    module._device_mesh = mesh


def training_loaders(trainer: Trainer) -> list[object]:
    """The fit's training loaders, as the strategy prepared them (the combined loader's, flattened)."""
    combined = trainer.fit_loop._combined_loader
    return [] if combined is None else list(combined.flattened)


def combined_mode(trainer: Trainer) -> str:
    """How the fit's ``CombinedLoader`` steps through its loaders (``"max_size_cycle"`` unless the user chose)."""
    combined = trainer.fit_loop._combined_loader
    return "max_size_cycle" if combined is None else str(combined._mode)


def training_loader_count(trainer: Trainer) -> int:
    """How many DataLoaders the fit trains on (Lightning's ``CombinedLoader`` of ``train_dataloader``)."""
    combined = trainer.fit_loop._combined_loader
    return 0 if combined is None else len(combined.flattened)


def resume_position(trainer: Trainer) -> int | None:
    """The batch a resumed fit continues its epoch from, or ``None`` when the fit starts afresh."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return progress.ready if trainer.fit_loop.restarting or progress.ready > 0 else None


def accumulation_at(trainer: Trainer, epoch: int) -> int:
    """``accumulate_grad_batches`` in force during ``epoch``: a GradientAccumulationScheduler sets it only in its
    own ``on_train_epoch_start``, after oscars sized the epoch, so ask the scheduler."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, GradientAccumulationScheduler):
            return int(callback.get_accumulate_grad_batches(epoch))
    return int(trainer.accumulate_grad_batches)


def unwrap_sampler(sampler: object) -> object:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper`` (or ``sampler`` itself)."""
    if isinstance(sampler, DistributedSamplerWrapper):
        return sampler.dataset._sampler  # type: ignore[attr-defined]
    return sampler


# ---------------------------------------------------------------------- signals, checkpoints, results


def mark_sigterm(trainer: Trainer) -> None:
    """Some rank received SIGTERM: Lightning raises ``SIGTERMException`` on every rank at this batch."""
    trainer._signal_connector.received_sigterm = True


def checkpoint_due(trainer: Trainer) -> bool:
    """Whether a ``ModelCheckpoint`` saves by ``every_n_train_steps`` at this batch's end (Lightning's own test,
    the same on every rank: the global step is)."""
    for callback in trainer.checkpoint_callbacks:
        every = getattr(callback, "_every_n_train_steps", 0)
        if isinstance(callback, ModelCheckpoint) and every >= 1 and trainer.global_step % every == 0:
            if not callback._should_skip_saving_checkpoint(trainer):
                return True
    return False


def time_interval_checkpoints(trainer: Trainer) -> list[ModelCheckpoint]:
    """``ModelCheckpoint(train_time_interval=...)`` callbacks: they broadcast their decision at every batch."""
    return [
        cb
        for cb in trainer.checkpoint_callbacks
        if isinstance(cb, ModelCheckpoint) and cb._train_time_interval is not None
    ]


def epoch_results(trainer: Trainer) -> Any:
    return trainer._results


def training_results(trainer: Trainer) -> Any:
    """The training loop's logged values (``trainer._results`` is the validation loop's during validation)."""
    return trainer.fit_loop.epoch_loop._results


def callback_metric_store(trainer: Trainer) -> dict[str, Any]:
    """Lightning's store behind ``trainer.callback_metrics``: it keeps the last step values between epochs."""
    return trainer._logger_connector._callback_metrics


def trainer_of(module: LightningModule | None) -> Trainer | None:
    # After a spawn-launched fit the main process holds a module no longer attached to a Trainer, and
    # LightningModule.trainer raises then.
    return None if module is None else module._trainer


def averaged_copies(trainer: Trainer) -> list[torch.nn.Module]:
    """Averaged copies of the model that callbacks update from each rank's weights (``WeightAveraging``, EMA).
    Averaged with the model each round they stay equal on every rank: the update is linear and runs at the
    same global steps everywhere."""
    callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
    return [cb._average_model for cb in callbacks if isinstance(cb, WeightAveraging) and cb._average_model]


def unsupported(trainer: Trainer, module: LightningModule) -> str | None:
    """Why this fit cannot run under oscars, or ``None``."""
    if time_based_validation(trainer):
        return (
            "A time-based val_check_interval is decided on each rank's own clock; under oscars use an int or"
            " float val_check_interval, or strategy='ddp'."
        )
    if trainer.overfit_batches > 0:  # type: ignore[attr-defined]
        return "overfit_batches is not supported by strategy='oscars'; use strategy='ddp'"
    if isinstance(trainer.fit_loop._data_fetcher, _DataLoaderIterDataFetcher) or (
        "dataloader_iter" in inspect.signature(module.training_step).parameters
    ):
        return "training_step(dataloader_iter) is not supported by strategy='oscars'"
    return None


def sync_batchnorm_problem(strategy: Any) -> str | None:
    """Why the fit cannot run if the Trainer asked for ``sync_batchnorm`` (its connector hands the strategy a
    layer sync), else ``None``."""
    if getattr(strategy, "_layer_sync", None) is None:
        return None
    return (
        "sync_batchnorm=True all-reduces inside every forward pass, which oscars' local steps cannot allow;"
        " BatchNorm statistics are averaged at every round instead. Remove sync_batchnorm, or use strategy='ddp'."
    )


def collective_timeout_s(strategy: Any, default: float) -> float:
    """The collective timeout a ``DDPStrategy`` was built with (its private ``_timeout``), in seconds."""
    timeout = getattr(strategy, "_timeout", None)
    return timeout.total_seconds() if timeout is not None else default


def full_checkpoint(trainer: Trainer) -> dict[str, Any]:
    """Everything ``trainer.save_checkpoint`` would write (model, optimizers, loops, callbacks), as a dict, on this
    rank alone: no barrier, no write, nothing rank 0 must do (a survivor of a failed round saves it)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def rng_states() -> dict[str, Any]:
    """This process's random generators (torch, CUDA, NumPy, Python), as Lightning collects them, with NumPy's
    key array as a tensor: a restore loads checkpoints with ``weights_only``, which refuses NumPy arrays."""
    states = _collect_rng_states()
    if "numpy" in states:
        name, key, *rest = states["numpy"]
        states["numpy"] = (name, torch.from_numpy(key.astype("int64")), *rest)
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    if "numpy" in states:
        name, key, *rest = states["numpy"]
        states = {**states, "numpy": (name, key.numpy().astype("uint32"), *rest)}
    _set_rng_states(states)


def resume_from_unless_given(trainer: Trainer, path: str, given_before: float) -> None:
    """Make this fit's restore load ``path`` when it was given no checkpoint, or one written before the time
    ``given_before``. Lightning picks the checkpoint before the strategy's setup, with no hook to change it; the
    connector's ``resume_start`` is replaced on the instance for one call."""
    connector = trainer._checkpoint_connector
    original = connector.resume_start

    def resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        del connector.resume_start  # one call: the class's own method is back
        given = checkpoint_path is not None and os.path.isfile(checkpoint_path)
        if checkpoint_path is None or (given and os.path.getmtime(checkpoint_path) < given_before):
            checkpoint_path = path
        original(checkpoint_path, weights_only=weights_only)

    connector.resume_start = resume_start  # type: ignore[method-assign]


def sync_module_states(module: torch.nn.Module) -> None:
    """Start every rank from rank 0's parameters and buffers (what the DDP wrapper would do)."""
    _sync_module_states(module)
