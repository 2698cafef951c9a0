"""One rank of a 2-"node" oscars fit, started by a cluster launcher (see tests/test_torchrun.py).

torchrun:  python -m torch.distributed.run --nnodes=2 --nproc-per-node=1 --node-rank=R --master-addr=127.0.0.1
           --master-port=P tests/torchrun_job.py OUT_DIR
srun:      srun --nodes=2 --ntasks-per-node=1 python tests/torchrun_job.py OUT_DIR (or its SLURM_* variables)

Lightning detects TorchElasticEnvironment or SLURMEnvironment from the launcher's variables; global rank 1 is
emulated 3x slower. Each rank writes OUT_DIR/rank{global_rank}.json.

With OSCARS_TEST_NODE_REPLICAS=1 (torchrun ``--nproc-per-node=2``): two ranks per node, each node one replica
(``replica_size="node"``), the second node's ranks 3x slower; with OSCARS_TEST_SHARD=1 as well, each replica's model
sharded between its two ranks (``shard_replicas=True``)."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from toy import ToyModule  # noqa: E402

import lightning_oscars  # noqa: E402,F401  (registers strategy="oscars")
from lightning_oscars import HeterogeneityEmulator  # noqa: E402


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded parameter gathered inside its replica (every rank of it calls this alike), or the tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def main() -> None:
    out = Path(sys.argv[1])
    dump_after = float(os.environ.get("OSCARS_TEST_DUMP_AFTER", "0"))
    if dump_after > 0:  # a hang prints this rank's stacks and exits instead of waiting forever
        faulthandler.dump_traceback_later(dump_after, exit=True)
    module = ToyModule(step_cost=0.004)
    node_replicas = os.environ.get("OSCARS_TEST_NODE_REPLICAS") == "1"
    shard = os.environ.get("OSCARS_TEST_SHARD") == "1"  # and each replica sharded with FSDP2
    strategy_arg: Any = (
        lightning_oscars.OscarsStrategy(replica_size="node", shard_replicas=shard) if node_replicas else "oscars"
    )
    trainer = L.Trainer(
        strategy=strategy_arg,
        accelerator="cpu",
        devices=2 if node_replicas else 1,
        num_nodes=2,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[HeterogeneityEmulator({2: 3.0, 3: 3.0} if node_replicas else {1: 3.0})],
    )
    result: dict = {}
    try:
        trainer.fit(module)
    except Exception as error:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(error).__name__}: {error}"
    strategy: Any = trainer.strategy
    schedule = getattr(strategy, "schedule", None)
    result.update(
        rank=trainer.global_rank,
        node_rank=trainer.node_rank,
        local_rank=trainer.local_rank,
        world_size=trainer.world_size,
        replica=strategy.layout.replica_of(trainer.global_rank),
        strategy=type(strategy).__name__,
        cluster_environment=type(strategy.cluster_environment).__name__,
        schedule=list(schedule.local_steps) if schedule is not None else None,
        num_averagings=getattr(strategy, "num_averagings", 0),
        weights=torch.cat([whole(t).detach().float().reshape(-1) for t in module.state_dict().values()]).tolist(),
        sharded=any(isinstance(p, DTensor) for p in module.parameters()),
        global_step=trainer.global_step,
        steps_taken=module.steps_taken,
        seen=module.seen,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if "error" not in result and torch.distributed.is_initialized():
        # Leave together and close the group: rank 0 hosts the rendezvous store, and a peer whose store client
        # outlives it can abort at interpreter exit ("terminate called without an active exception").
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
