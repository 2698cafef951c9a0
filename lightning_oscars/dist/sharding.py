"""Sharded replicas: torch's FSDP2 inside a replica, oscars' averaging of each shard across the replicas.

A replica of ``k`` ranks holds one model sharded among them by ``torch.distributed.fsdp.fully_shard`` on the
replica's ranks (parameters, gradients and optimizer state split ``k`` ways, gradients reduce-scattered every step on
the replica's group). The ranks holding the same shard in the different replicas form a *shard group*; a round's
averaging all-reduces each rank's local shards over its shard group only, so a rank sends ``1/k`` of the model. The
rest (buffers such as BatchNorm's statistics, which FSDP2 leaves unsharded and each rank updates on its own micro-
batches) rides with the round's control data in the usual all-reduce over every rank, which also makes it equal on the
ranks of one replica.

:func:`replica_mesh` makes the device mesh, dims ``("replicate", "data_parallel", "tensor_parallel")`` of shape
``(replicas, k, 1)``: ``mesh["data_parallel"]`` is the replica's ranks (what ``fully_shard`` takes),
``mesh["replicate"]`` the shard group. Nothing here knows about Lightning.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_oscars.core.replicas import ReplicaLayout
from lightning_oscars.dist.averaging import FlatAverager
from lightning_oscars.dist.schemes import RoundMeeting, SyncScheme

__all__ = [
    "MESH_DIMS",
    "require_fully_shard",
    "ShardedModelAveraging",
    "SHARD_OPTIONS",
    "check_shardable",
    "fsdp_keywords",
    "keyed_by_name",
    "keyed_by_position",
    "local_part",
    "parameter_names",
    "reshard_gathered",
    "replica_mesh",
    "shard_by_default",
    "sharded_parameters",
    "split_sharded",
    "sync_sharded_states",
]

MESH_DIMS = ("replicate", "data_parallel", "tensor_parallel")
# FSDP2's own options (``fully_shard``'s keywords) that the default sharding takes from ``shard_options``.
SHARD_OPTIONS = ("reshard_after_forward", "mp_policy", "offload_policy")


def fsdp_keywords(options: dict[str, Any] | None) -> dict[str, Any]:
    """``fully_shard`` keywords from ``shard_options``: FSDP2's own values, or for ``mp_policy`` a dict of
    ``MixedPrecisionPolicy``'s fields with dtypes by name (``{"param_dtype": "bfloat16"}``, as a config file writes
    it) and for ``offload_policy`` ``"cpu"`` (``CPUOffloadPolicy()``). Errors name an unknown key or a bad value."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError(f"shard_options must be a dict of fully_shard's keywords, got {options!r}")
    unknown = sorted(set(options) - set(SHARD_OPTIONS))
    if unknown:
        raise ValueError(f"shard_options takes {list(SHARD_OPTIONS)} (FSDP2's fully_shard keywords), got {unknown}")
    keywords = dict(options)
    reshard = keywords.get("reshard_after_forward", True)
    if not isinstance(reshard, bool) and (not isinstance(reshard, int) or reshard < 1):
        raise ValueError(f"shard_options['reshard_after_forward'] must be True, False or a group size, got {reshard!r}")
    if "mp_policy" in keywords:
        keywords["mp_policy"] = _mixed_precision(keywords["mp_policy"])
    offload = keywords.get("offload_policy")
    if offload == "cpu":
        keywords["offload_policy"] = CPUOffloadPolicy()
    elif offload is not None and not isinstance(offload, OffloadPolicy):
        raise ValueError(f"shard_options['offload_policy'] must be 'cpu' or an OffloadPolicy, got {offload!r}")
    return keywords


def _mixed_precision(policy: Any) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    if not isinstance(policy, dict):
        raise ValueError(f"shard_options['mp_policy'] must be a MixedPrecisionPolicy or a dict, got {policy!r}")
    fields: dict[str, Any] = {}
    for name, value in policy.items():
        if name == "cast_forward_inputs":
            fields[name] = value
            continue
        dtype = getattr(torch, value, value) if isinstance(value, str) else value
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(f"shard_options['mp_policy'][{name!r}] must be a dtype or its name, got {value!r}")
        fields[name] = dtype
    try:
        return MixedPrecisionPolicy(**fields)
    except TypeError as error:
        raise ValueError(f"shard_options['mp_policy']: {error}") from None


# The meshes made in this process, by shape, with the world they were made in: a repeated fit (or another Trainer)
# reuses its groups, since every init_device_mesh makes new process groups that live as long as the world does.
_MESHES: dict[tuple[int, int, str], tuple[Any, DeviceMesh]] = {}


def replica_mesh(layout: ReplicaLayout, device_type: str) -> DeviceMesh:
    """The run's device mesh (collective: every rank makes every group, the first time for this shape and world).
    Replica ``r`` holds the consecutive ranks of ``layout``, as :class:`~lightning_oscars.core.replicas.ReplicaLayout`
    places them."""
    key = (layout.replicas, layout.replica_size, device_type)
    world = dist.group.WORLD
    cached = _MESHES.get(key)
    if cached is not None and cached[0] is world:
        return cached[1]
    mesh = init_device_mesh(device_type, (layout.replicas, layout.replica_size, 1), mesh_dim_names=MESH_DIMS)
    _MESHES[key] = (world, mesh)
    return mesh


def sharded_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if isinstance(p, DTensor)]


def check_shardable(module: nn.Module) -> None:
    """Errors naming what sharded replicas cannot train: FSDP1, and parameters outside every sharded submodule."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise TypeError(
            "shard_replicas=True shards with torch's FSDP2 (torch.distributed.fsdp.fully_shard); this module holds"
            " FullyShardedDataParallel (FSDP1) wrappers. Call fully_shard(..., mesh=self.device_mesh['data_parallel'])"
            " in configure_model instead, or let the strategy shard the module."
        )


def require_fully_shard() -> None:
    """Raise naming the release when this torch has no public FSDP2 (``torch.distributed.fsdp.fully_shard``, torch
    2.6 and newer), which sharded replicas are built on."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"shard_replicas=True needs torch 2.6 or newer (FSDP2's torch.distributed.fsdp.fully_shard); this is torch"
            f" {torch.__version__}. Upgrade torch, or train DDP replicas (shard_replicas=False)."
        ) from error


def shard_by_default(module: nn.Module, mesh: DeviceMesh, **fsdp_options: Any) -> list[str]:
    """Shard ``module`` when its ``configure_model`` sharded nothing: each top-level child holding parameters is one
    FSDP2 unit (its parameters gathered for its forward, freed after). The root is not: a LightningModule's own
    ``forward`` is not what Lightning calls, so FSDP2's hooks on it would never gather its parameters. Returns the
    children sharded; parameters held by the root itself are an error naming them."""
    from torch.distributed.fsdp import fully_shard

    direct = [name for name, _ in module.named_parameters(recurse=False)]
    if direct:
        raise ValueError(
            f"shard_replicas=True: the parameters {direct} belong to the LightningModule itself, which FSDP2 cannot"
            " shard (Lightning does not call its forward). Move them into a submodule, or shard the module yourself"
            " in configure_model."
        )
    sharded = []
    for name, child in module.named_children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, **fsdp_options)
            sharded.append(name)
    return sharded


def reshard_gathered(modules: Iterable[nn.Module]) -> None:
    """Put back the shards wherever FSDP2 left a module's parameters gathered: it keeps its root module's whole
    parameters after a forward for the backward it expects, and a forward without one (validation, a callback's
    no-grad forward) leaves them so until the next backward. Held whole, they cost a rank the full model's memory, and
    an averaging would see whole tensors where the rank's replica partners see shards (a collective mismatch) and
    change copies that FSDP2 then frees. Not collective; nothing to do for modules FSDP2 does not shard."""
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        for part in module.modules():
            if isinstance(part, FSDPModule):
                part.reshard()


def parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of ``optimizer``'s parameters in ``module``, in the optimizer's order (the positions an unsharded
    optimizer's ``state_dict`` keys its state by)."""
    names = {id(p): name for name, p in module.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def keyed_by_position(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter name (torch's ``get_optimizer_state_dict``) keyed by position, as
    ``Optimizer.state_dict()`` keys it: a checkpoint of sharded replicas loads into an unsharded optimizer."""
    position = {name: i for i, name in enumerate(names)}
    groups = [{**g, "params": [position[n] for n in g["params"]]} for g in state["param_groups"]]
    return {"state": {position[n]: s for n, s in state["state"].items()}, "param_groups": groups}


def keyed_by_name(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The inverse of :func:`keyed_by_position` (for ``set_optimizer_state_dict``)."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {names[i]: s for i, s in state["state"].items()}, "param_groups": groups}


def local_part(tensor: Tensor) -> Tensor:
    """This rank's shard of a sharded parameter (a view: writing it writes the parameter), or ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def split_sharded(tensors: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """``(this rank's shards of the sharded tensors, the other tensors)``, each in the given order."""
    shards = [t.detach().to_local() for t in tensors if isinstance(t, DTensor)]  # type: ignore[attr-defined]
    return shards, [t for t in tensors if not isinstance(t, DTensor)]


def sync_sharded_states(module: nn.Module, mesh: DeviceMesh) -> None:
    """Start every replica from replica 0's model: each shard from the rank holding it in replica 0 (over the shard
    group), the unsharded tensors (buffers) from rank 0 (collective: every rank)."""
    shards, rest = split_sharded([*module.parameters(), *module.buffers()])
    group = mesh["replicate"].get_group()
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for shard in shards:
            dist.broadcast(shard, src=source, group=group)
        for tensor in rest:
            dist.broadcast(tensor, src=0)


class ShardedModelAveraging(SyncScheme):
    """The weighted mean over replicas of every shard, over its shard group, and of the unsharded tensors with the
    round's control data, over every rank: two all-reduces, the large one ``1/k`` of the model.

    Args:
        shard_group: the ranks holding this rank's shard in every replica (``mesh["replicate"]``).
        device: where the flat buffers live (by default the meeting's device).
    """

    name = "sharded_model_averaging"

    def __init__(self, shard_group: Any, device: torch.device | str | None = None) -> None:
        self.shard_group = shard_group
        self.device = None if device is None else torch.device(device)
        self._shards: FlatAverager | None = None
        self._sources: list[DTensor] = []  # the sharded parameters whose local views _shards holds
        self._rest: FlatAverager | None = None

    def average(self, tensors: Sequence[Tensor], meeting: RoundMeeting) -> None:
        device = self.device or meeting.device
        sources = [t for t in tensors if isinstance(t, DTensor)]
        rest = [t for t in tensors if not isinstance(t, DTensor)]
        if self._shards is None or len(sources) != len(self._sources) or any(
            a is not b for a, b in zip(sources, self._sources)
        ):
            # A sharded parameter keeps its local shard's storage between steps: its views are taken once.
            self._shards = FlatAverager([local_part(t.detach()) for t in sources], 1, device)
            self._sources = list(sources)
        # One rank per replica in a shard group: the weights sum to the replicas' total.
        self._shards.all_reduce(meeting.weight, [meeting.weight], 0, group=self.shard_group)
        control = meeting.control
        if self._rest is None or not self._rest.holds(rest) or self._rest.control_size != len(control):
            self._rest = FlatAverager(rest, len(control), device)
        meeting.deliver(self._rest.all_reduce(meeting.weight, control, meeting.weight_index))

    def combine(self, tensors: Sequence[Tensor], meeting: RoundMeeting) -> None:
        self.average(tensors, meeting)

    def release(self) -> None:
        self._shards = self._rest = None
        self._sources = []
