"""In-process checks: construction errors, registration and the single-device fallback."""

import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
from toy import ToyModule

import lightning_oscars
from lightning_oscars import OscarsStrategy


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_spread": 0}, "max_spread"),
        ({"max_local_steps": -1}, "max_local_steps"),
        ({"averaging": "median"}, "averaging"),
        ({"solver": "magic"}, "solver"),
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"step_times": [0.1, float("nan")]}, "step_times"),
        ({"step_times": [0.1, -1.0]}, "step_times"),
        ({"local_steps": [2, 0]}, "local_steps"),
        ({"efficiency_tolerance": 2.0}, "efficiency_tolerance"),
        ({"smoothing": 0.0}, "smoothing"),
        ({"model_averaging_period": 4}, "model_averaging_period"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        OscarsStrategy(**kwargs)


@pytest.mark.parametrize("hook", ["ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"])
def test_ddp_gradient_hooks_are_rejected(hook):
    with pytest.raises(ValueError, match=f"{hook} is a DDP gradient-hook option"):
        OscarsStrategy(**{hook: print})


def test_ddp_wrapper_options_are_ignored_with_a_warning():
    # A ddp call site such as DDPStrategy(find_unused_parameters=True) keeps working when the class changes.
    with pytest.warns(UserWarning, match="ignoring find_unused_parameters, static_graph"):
        strategy = OscarsStrategy(static_graph=True, find_unused_parameters=True, max_spread=3)
    assert strategy.max_spread == 3
    assert not strategy._ddp_kwargs, "nothing reaches a DistributedDataParallel wrapper"


def test_trainer_plumbing_reaches_ddp_strategy():
    environment = SLURMEnvironment()
    strategy = OscarsStrategy(cluster_environment=environment, parallel_devices=[torch.device("cpu")] * 2)
    assert strategy.cluster_environment is environment
    assert strategy.parallel_devices == [torch.device("cpu")] * 2


def test_registered_names():
    for name in ("oscars", "oscars_alg1", "local_sgd"):
        assert name in StrategyRegistry
    assert StrategyRegistry["local_sgd"]["init_params"] == {"solver": "uniform"}
    assert lightning_oscars.__version__


def test_single_device_degenerates_to_plain_training(tmp_path):
    torch.manual_seed(0)
    model = ToyModule()
    trainer = Trainer(
        strategy="oscars",
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model)
    assert isinstance(trainer.strategy, OscarsStrategy)
    assert trainer.global_step == 32  # 512 samples / 16
    assert model.seen == 512
    assert trainer.strategy.num_averagings == 0
