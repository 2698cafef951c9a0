"""``batch_sizes="auto"``: the memory model's arithmetic, the probe measured for real on the CPU (bytes of the tensors a
step keeps for its backward pass, read by autograd's saved-tensor hooks, against a given capacity), what the probe
leaves behind (nothing), and the option off CUDA. The CUDA gauge itself needs a GPU: ``benchmarks/gpu_check.py``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import lightning as L
import pytest
import torch
from test_averaging import gloo  # noqa: F401 - the one-rank gloo group fixture
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_oscars import OscarsStrategy
from lightning_oscars.core.memory_fit import MemoryModel, scaled_batch_sizes
from lightning_oscars.lightning.batch_probe import auto_batch_fits, probe_largest_batch, probe_problem


def test_the_memory_line_is_fitted_and_met_at_the_capacity_less_margin_and_reserve():
    model = MemoryModel.fit([(8, 1_000 + 8 * 50), (16, 1_000 + 16 * 50), (32, 1_000 + 32 * 50)])
    assert model.fixed == pytest.approx(1_000) and model.per_sample == pytest.approx(50)
    # (10_000 x 0.9 - 500 - 1_000) / 50 = 150
    assert model.largest_batch(10_000, reserved=500, margin=0.1) == 150
    assert model.peak(150) + 500 <= 9_000 < model.peak(151) + 500
    assert model.largest_batch(1_000, margin=0.0) == 0  # not one sample beside the fixed part
    assert MemoryModel(100, 0).largest_batch(1_000, limit=4096) == 4096  # no per-sample growth: the limit
    with pytest.raises(ValueError, match="two batch sizes"):
        MemoryModel.fit([(8, 1.0), (8, 2.0)])
    with pytest.raises(ValueError, match="margin"):
        model.largest_batch(10_000, margin=1.0)


@pytest.mark.parametrize(
    ("fits", "batch_size", "expected"),
    [
        ([200, 100], 32, [64, 32]),  # memory 2:1: batches 2:1 around the user's 32
        ([100, 100, 150], 32, [32, 32, 48]),
        ([20, 100], 32, [20, 100]),  # the user's batch does not fit the smallest: its fit, the others in proportion
        ([7], 64, [7]),
    ],
)
def test_local_steps_scale_the_users_batch_by_what_each_rank_fits(fits, batch_size, expected):
    sizes = scaled_batch_sizes(fits, batch_size)
    assert sizes == expected and all(s <= f for s, f in zip(sizes, fits))


def test_scaled_sizes_refuse_a_rank_that_fits_nothing():
    with pytest.raises(ValueError, match="at least one sample"):
        scaled_batch_sizes([0, 10], 8)


class SavedTensorsGauge:
    """Bytes of the tensors autograd keeps for the backward pass during a step (their peak), against ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self._capacity, self._peak = capacity, 0

    @contextmanager
    def measure(self) -> Iterator[None]:
        live = [0]
        self._peak = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            live[0] += tensor.numel() * tensor.element_size()
            self._peak = max(self._peak, live[0])
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield

    def peak(self) -> int:
        return self._peak

    def capacity(self) -> int:
        return self._capacity


class Probed(L.LightningModule):
    """BatchNorm (running statistics the probe must put back), dropout (random numbers it must not consume) and
    ``self.log`` in the step (outside any loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return {"loss": loss}


def _loader(batch_size: int = 16) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(40, 16), torch.randint(0, 4, (40,))), batch_size=batch_size)


def _measured(module: Probed, loader: DataLoader, n: int) -> int:
    gauge = SavedTensorsGauge(0)
    x, y = loader.collate_fn([loader.dataset[i % len(loader.dataset)] for i in range(n)])
    with gauge.measure():
        nn.functional.cross_entropy(module.net(x), y).backward()
    module.zero_grad(set_to_none=True)
    return gauge.peak()


def test_the_probe_finds_the_largest_batch_whose_measured_step_fits():
    module, loader = Probed(), _loader()
    capacity, margin, optimizer = 400_000, 0.1, torch.optim.SGD(Probed().parameters(), lr=0.1)  # no state: 0 reserved
    found = probe_largest_batch(module, loader, SavedTensorsGauge(capacity), optimizers=[optimizer], margin=margin)
    budget = capacity * (1 - margin)
    assert found > 16, "more than the user's batch fits"
    assert _measured(module, loader, found) <= budget < _measured(module, loader, found + 1)


def test_the_probe_reserves_adams_state_before_its_first_step():
    module, loader = Probed(), _loader()
    parameters = sum(p.numel() * p.element_size() for p in module.parameters())
    gauge = SavedTensorsGauge(400_000)
    plain = probe_largest_batch(module, loader, gauge, optimizers=[torch.optim.SGD(module.parameters(), lr=0.1)])
    adam = probe_largest_batch(module, loader, gauge, optimizers=[torch.optim.Adam(module.parameters())])
    per_sample = (_measured(module, loader, 32) - _measured(module, loader, 16)) / 16
    assert plain - adam == pytest.approx(2 * parameters / per_sample, abs=1)


def test_the_probe_leaves_no_trace():
    torch.manual_seed(0)
    module, loader = Probed(), _loader()
    module.eval()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    rng = torch.get_rng_state()
    probe_largest_batch(module, loader, SavedTensorsGauge(10**9))
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "parameters and BatchNorm statistics as they were"
    assert torch.equal(torch.get_rng_state(), rng), "dropout's random numbers not consumed"
    assert all(p.grad is None for p in module.parameters())
    assert not any(m.training for m in module.modules()), "eval mode as it was"
    assert "log" not in vars(module) and "log_dict" not in vars(module), "self.log is the module's own again"


def test_the_probe_is_not_run_where_its_collectives_could_not_stay_matched(gloo):  # noqa: F811
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    assert probe_problem(Probed(), _loader()) is None
    manual = Probed()
    manual.automatic_optimization = False
    assert "manual optimization" in (probe_problem(manual, _loader()) or "")
    assert "map-style" in (probe_problem(Probed(), [1, 2]) or "")
    sharded = Probed()
    fully_shard(sharded.net, mesh=init_device_mesh("cpu", (1,)))
    assert "sharded" in (probe_problem(sharded, _loader()) or "")


def test_off_cuda_auto_keeps_the_dataloaders_batch_size_and_the_option_is_taken():
    class CpuStrategy:
        root_device = torch.device("cpu")
        lightning_module = Probed()

    assert auto_batch_fits(CpuStrategy(), _loader()) is None  # type: ignore[arg-type]
    assert OscarsStrategy(batch_sizes="auto").batch_sizes == "auto"
    assert OscarsStrategy(balance="batch", batch_sizes="auto").batch_sizes == "auto"
    with pytest.raises(ValueError, match="or 'auto'"):
        OscarsStrategy(batch_sizes="max")  # type: ignore[arg-type]
