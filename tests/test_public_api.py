"""What users import and name stays as it was when the modules moved into layer folders: the names the package
exports, the strategies registered by name, the ``oscars-timeline`` command, and the keys a checkpoint holds
(``tests/test_multiprocess.py`` resumes a fit from a checkpoint written before the move)."""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from pathlib import Path

import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_oscars

# As exported by 0.1.0 before the sub-packages (lightning_oscars/__init__.py at 8ff9914).
PUBLIC = {
    "ASPStrategy",
    "BSPStrategy",
    "DASPStrategy",
    "DSSPStrategy",
    "EpochPlan",
    "HeterogeneityEmulator",
    "LoadBalancedLoader",
    "ModelAveraging",
    "OscarsStrategy",
    "ParameterServerStrategy",
    "RipplesStrategy",
    "RoundController",
    "RoundOutcome",
    "RoundMeeting",
    "RoundRecord",
    "SSPStrategy",
    "StepSyncStrategy",
    "SUPPORTED_LIGHTNING",
    "Schedule",
    "ScheduleMonitor",
    "SchedulePolicy",
    "SlowdownProfile",
    "SyncScheme",
    "check_lightning_version",
    "plan_rounds",
    "planned_slots",
    "plot_timeline",
    "round_metrics",
    "round_quotas",
    "schedule_from_local_steps",
    "solve_schedule",
    "solve_schedule_alg1",
    "summarize_history",
}
REGISTERED = {
    "oscars": "OscarsStrategy",
    "oscars_alg1": "OscarsStrategy",
    "local_sgd": "OscarsStrategy",
    "every_step_averaging": "OscarsStrategy",
    "bsp": "BSPStrategy",
    "asp": "ASPStrategy",
    "ssp": "SSPStrategy",
    "dssp": "DSSPStrategy",
    "dasp": "DASPStrategy",
    "ripples": "RipplesStrategy",
}
CHECKPOINT = Path(__file__).parent / "data" / "premove_midepoch.ckpt"


def test_the_package_exports_the_same_names():
    assert set(lightning_oscars.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(lightning_oscars, name) is not None, name
    assert callable(lightning_oscars.plot_timeline)


def test_the_same_strategies_are_registered_by_name():
    for name, cls in REGISTERED.items():
        assert name in StrategyRegistry, name
        assert StrategyRegistry[name]["strategy"] is getattr(lightning_oscars, cls), name


def test_the_timeline_command_is_installed():
    (command,) = [e for e in entry_points(group="console_scripts") if e.name == "oscars-timeline"]
    from lightning_oscars.core.timeline import main

    assert command.load() is main


def test_a_checkpoint_written_before_the_move_holds_plain_values_under_the_same_keys():
    """Loaded with ``weights_only`` (no class of ours pickled: a module path can move), and the round state under
    ``"oscars"`` has the keys the strategy restores from."""
    checkpoint = torch.load(CHECKPOINT, weights_only=True)
    state = checkpoint["oscars"]
    assert {"world_size", "replica_size", "plan", "plan_epoch", "local_steps", "step_times", "scheme"} <= set(state)
    assert state["world_size"] == 2 and state["plan"]["total_units"] > 0
    written = json.loads(CHECKPOINT.with_suffix(".json").read_text())
    assert sum(written["trained_before_step_5"]) == 112


def test_the_round_state_written_today_has_the_keys_the_old_checkpoint_has():
    """A checkpoint written now is read by the same code: its ``"oscars"`` keys are the old ones (none dropped)."""
    from lightning_oscars import OscarsStrategy, RoundController, SchedulePolicy

    old = set(torch.load(CHECKPOINT, weights_only=True)["oscars"])
    rounds = RoundController(SchedulePolicy(), rank=0, world_size=2)
    now = set(rounds.state_dict()) | {"scheme"}
    assert old <= now, sorted(old - now)
    assert OscarsStrategy().state_dict() == {}  # outside a fit
