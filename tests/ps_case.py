"""Two workers on the in-job parameter server, launched by Lightning Fabric's subprocess launcher (gloo on CPU).

``python tests/ps_case.py CASE OUT``: every rank writes ``OUT/rankN.json``. Cases:

* ``bsp``: SGD with momentum on BSP, and the ddp trajectory computed in the same process for comparison;
* ``ssp`` / ``asp``: rank 1 six times slower; what rank 0 saw when it finished.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from lightning_oscars.core.staleness import ASP, BSP, SSP
from lightning_oscars.dist.param_server import ParameterServer

STEPS = 20


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 5, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def flat(model: torch.nn.Module) -> torch.Tensor:
    return parameters_to_vector(model.parameters()).detach().clone()


def loss_of(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def ddp_reference(world_size: int) -> torch.Tensor:
    """What ddp computes: every step on the mean of the ranks' gradients."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        (sum(loss_of(model, r, step) for r in range(world_size)) / world_size).backward()
        opt.step()
    return flat(model)


def main() -> None:
    case, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rule = {"bsp": BSP(), "ssp": SSP(2), "asp": ASP()}[case]
    server = ParameterServer(flat(model), rule, timeout_s=60)
    step_s = 0.005 * (6 if rank == 1 and case != "bsp" else 1)
    result: dict = {"rank": rank}
    for step in range(STEPS):
        before = flat(model)
        began = time.perf_counter()
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        opt.step()
        time.sleep(step_s)
        new = server.push_pull(flat(model) - before, busy_s=time.perf_counter() - began)
        vector_to_parameters(new, model.parameters())
    # Right after this worker's last iteration: how far the other had got on this rank's own shard.
    result["other_clock_at_finish"] = server.shard.clocks[1 - rank]
    torch.distributed.barrier()  # every push is applied (each push's reply came after it was)
    final = server.pull()
    result.update(
        final=final.tolist(),
        staleness=list(server.staleness()),
        waited_s=server.waited_s,
        clock=server.clock,
    )
    if case == "bsp":
        result["ddp"] = ddp_reference(world).tolist()
        result["trained"] = flat(model).tolist()
    server.close()
    result["server_alive"] = server._thread.is_alive()
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
