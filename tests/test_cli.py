"""LightningCLI: the example configs parse to the configured strategy, ``--print_config`` shows every OscarsStrategy
option, and every config trains on 2 CPU ranks (subprocess, hard timeout)."""

from __future__ import annotations

import csv
import inspect
import json
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.strategies import DDPStrategy
from subproc import ROOT, as_cli, load_script, run_in_pairs

from lightning_oscars import HeterogeneityEmulator, OscarsStrategy

CONFIGS = ROOT / "examples" / "configs"
CLI = ROOT / "examples" / "cli.py"
TIMEOUT = 120

# OscarsStrategy option -> the attribute that holds it after construction.
ATTRIBUTE = {
    "step_times": "pinned_step_times",
    "local_steps": "pinned_local_steps",
    "timeout": "_timeout",
    "start_method": "_start_method",
    "process_group_backend": "_process_group_backend",
}


# Constructor arguments the Trainer fills in (as for every strategy): not options a config sets.
PLUMBING = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}


def _options() -> dict[str, object]:
    """OscarsStrategy's own constructor options and their defaults (``**kwargs`` are ignored DDP-wrapper options)."""
    params = inspect.signature(OscarsStrategy.__init__).parameters.values()
    return {
        p.name: p.default for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD and p.name not in PLUMBING
    }


@pytest.fixture(scope="module")
def example_cli():
    return load_script(CLI, "oscars_example_cli")


@pytest.fixture(autouse=True)
def _isolated():
    with as_cli(CLI):
        yield


def _cli(example_cli, config: str, tmp_path: Path, *overrides: str):
    """Parse and instantiate (no fit) on one device, so no process is launched."""
    args = ["--config", str(CONFIGS / config), "--trainer.devices=1", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    return example_cli.main(args=[*args, *overrides], run=False)


def _as_timedelta(value: object) -> object:
    # YAML 1.1 reads an unquoted 0:30:00 as the base-60 integer 1800; jsonargparse writes it unquoted.
    if isinstance(value, int) and not isinstance(value, bool):
        return timedelta(seconds=value)
    if isinstance(value, str):
        h, m, s = value.split(":")
        return timedelta(hours=int(h), minutes=int(m), seconds=float(s))
    return value


# ---------------------------------------------------------------- in-process parsing


def test_full_config_lists_every_option_at_its_default():
    init_args = yaml.safe_load((CONFIGS / "oscars_full.yaml").read_text())["trainer"]["strategy"]["init_args"]
    options = _options()
    assert set(init_args) == set(options), "oscars_full.yaml must list exactly OscarsStrategy's options"
    for name, default in options.items():
        value = _as_timedelta(init_args[name]) if name == "timeout" else init_args[name]
        assert value == default, f"{name}: {value!r} in the config, default {default!r}"


def test_full_config_builds_strategy_with_every_option(example_cli, tmp_path):
    cli = _cli(example_cli, "oscars_full.yaml", tmp_path)
    strategy = cli.trainer.strategy
    assert type(strategy) is OscarsStrategy
    configured = yaml.safe_load((CONFIGS / "oscars_full.yaml").read_text())["trainer"]["strategy"]["init_args"]
    for name, value in configured.items():
        expected = _as_timedelta(value) if name == "timeout" else value
        assert getattr(strategy, ATTRIBUTE.get(name, name)) == expected, name
    # The rest of the config: emulator, linked model sizes.
    emulators = [cb for cb in cli.trainer.callbacks if isinstance(cb, HeterogeneityEmulator)]
    assert len(emulators) == 1 and emulators[0].factor_for(1, 0.0) == 3.0 and emulators[0].factor_for(0, 0.0) == 1.0
    first = cli.model.net[0]
    assert (first.in_features, cli.model.net[-1].out_features) == (32, 10)


def test_full_config_overrides_from_command_line(example_cli, tmp_path):
    cli = _cli(
        example_cli,
        "oscars_full.yaml",
        tmp_path,
        "--trainer.strategy.init_args.solver=alg1",
        "--trainer.strategy.init_args.max_spread=4",
        "--trainer.strategy.init_args.local_steps=[3, 1]",
        "--trainer.strategy.init_args.timeout=0:05:00",
        "--trainer.strategy.init_args.averaging=samples",
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, OscarsStrategy)
    assert (strategy.solver, strategy.max_spread, strategy.averaging) == ("alg1", 4, "samples")
    assert tuple(strategy.pinned_local_steps) == (3, 1)
    assert strategy._timeout == timedelta(minutes=5)


@pytest.mark.parametrize(
    ("given", "expected"),
    [("auto", "auto"), ("[64, 32]", [64, 32]), ('{"NVIDIA A100-SXM4-80GB": 64, "Tesla V100-SXM2-32GB": 24}', None)],
)
def test_batch_sizes_from_command_line(example_cli, tmp_path, given, expected):
    cli = _cli(example_cli, "oscars_full.yaml", tmp_path, f"--trainer.strategy.init_args.batch_sizes={given}")
    assert cli.trainer.strategy.batch_sizes == (expected if expected is not None else yaml.safe_load(given))


@pytest.mark.parametrize(("given", "expected"), [("node", "node"), ("4", 4)])
def test_replica_size_from_command_line(example_cli, tmp_path, given, expected):
    cli = _cli(example_cli, "oscars_full.yaml", tmp_path, f"--trainer.strategy.init_args.replica_size={given}")
    assert cli.trainer.strategy.replica_size == expected


def test_shard_options_from_command_line(example_cli, tmp_path):
    given = {"reshard_after_forward": False, "mp_policy": {"param_dtype": "bfloat16"}}
    prefix = "--trainer.strategy.init_args."
    sharded = [f"{prefix}replica_size=2", f"{prefix}shard_replicas=true", f"{prefix}save_distributed_checkpoint=false"]
    cli = _cli(example_cli, "oscars_full.yaml", tmp_path, *sharded, f"{prefix}shard_options={json.dumps(given)}")
    strategy = cli.trainer.strategy
    assert strategy.shard_options == given and strategy.save_distributed_checkpoint is False


def test_invalid_option_is_rejected(example_cli, tmp_path):
    with pytest.raises(SystemExit):  # jsonargparse: not one of the Literal values
        _cli(example_cli, "oscars_full.yaml", tmp_path, "--trainer.strategy.init_args.solver=fastest")


@pytest.mark.parametrize(("name", "solver"), [("oscars", "exact"), ("oscars_alg1", "alg1"), ("local_sgd", "uniform")])
def test_strategy_by_name_on_the_ddp_config(example_cli, tmp_path, name, solver):
    cli = _cli(example_cli, "ddp.yaml", tmp_path, f"--trainer.strategy={name}")
    assert isinstance(cli.trainer.strategy, OscarsStrategy)
    assert cli.trainer.strategy.solver == solver


def test_class_path_from_command_line(example_cli, tmp_path):
    # A bare --trainer.strategy=lightning_oscars.OscarsStrategy is read as a registry name (Trainer's strategy is
    # `str | Strategy`); the class is selected with .class_path, its options with .init_args.
    cli = _cli(
        example_cli,
        "ddp.yaml",
        tmp_path,
        "--trainer.strategy.class_path=lightning_oscars.OscarsStrategy",
        "--trainer.strategy.init_args.max_spread=3",
        "--trainer.strategy.init_args.step_times=[0.01, 0.03]",
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, OscarsStrategy)
    assert strategy.max_spread == 3 and tuple(strategy.pinned_step_times) == (0.01, 0.03)


def test_ddp_config_is_plain_ddp(example_cli, tmp_path):
    cli = _cli(example_cli, "ddp.yaml", tmp_path)
    assert isinstance(cli.trainer.strategy, DDPStrategy)
    assert not isinstance(cli.trainer.strategy, OscarsStrategy)


def test_oscars_config_by_name(example_cli, tmp_path):
    cli = _cli(example_cli, "oscars.yaml", tmp_path)
    strategy = cli.trainer.strategy
    assert type(strategy) is OscarsStrategy
    for name, default in _options().items():
        assert getattr(strategy, ATTRIBUTE.get(name, name)) == default, name


def test_print_config_shows_every_option_with_default(example_cli, capsys):
    with pytest.raises(SystemExit) as exit_info:
        example_cli.main(args=["fit", "--config", str(CONFIGS / "oscars_full.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)["trainer"]["strategy"]
    assert printed["class_path"] == "lightning_oscars.OscarsStrategy"
    for name, default in _options().items():
        assert f"      {name}: " in out, f"{name} missing from --print_config"
        value = printed["init_args"][name]
        assert (_as_timedelta(value) if name == "timeout" else value) == default, name
    # Only options that do something: none of the DistributedDataParallel wrapper's (oscars does not wrap).
    assert set(printed["init_args"]) == set(_options()) | PLUMBING


# ---------------------------------------------------------------- 2-rank fits


def _metrics(log_dir: Path) -> list[dict[str, str]]:
    files = list(log_dir.rglob("metrics.csv"))
    assert len(files) == 1, f"expected one metrics.csv under {log_dir}, found {files}"
    with files[0].open() as f:
        return list(csv.DictReader(f))


def _last(rows: list[dict[str, str]], column: str) -> float:
    values = [float(r[column]) for r in rows if r.get(column)]
    assert values, f"no {column!r} logged"
    return values[-1]


# ddp.yaml (the baseline config, no oscars in it) is fitted in the extended run only (`pytest -m extended`; CI runs it).
FIT_CONFIGS = ("oscars.yaml", "oscars_full.yaml")


def _fit_command(config: str, out: Path) -> list[str]:
    return [
        sys.executable,
        str(CLI),
        "fit",
        "--config",
        str(CONFIGS / config),
        "--trainer.max_epochs=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.logger.init_args.save_dir={out}",
    ]


@pytest.fixture(scope="module")
def config_fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int | None, str]]:
    """Every config fitted on 2 ranks, two launches at a time: its log directory, exit code and log."""
    dirs = {config: tmp_path_factory.mktemp(config.replace(".", "_")) for config in FIT_CONFIGS}
    runs = run_in_pairs([_fit_command(config, out) for config, out in dirs.items()], timeout=TIMEOUT)
    return {config: (out, code, log) for (config, out), (code, log) in zip(dirs.items(), runs)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", FIT_CONFIGS)
def test_config_fits_on_two_ranks(config, config_fits):
    _check_config_fit(config, *config_fits[config])


@pytest.mark.extended
@pytest.mark.multiprocess
def test_the_ddp_baseline_config_fits_on_two_ranks(tmp_path):
    ((code, log),) = run_in_pairs([_fit_command("ddp.yaml", tmp_path)], timeout=TIMEOUT)
    _check_config_fit("ddp.yaml", tmp_path, code, log)


def _check_config_fit(config: str, tmp_path: Path, code: int | None, log: str) -> None:
    assert code is not None, f"{config}: no exit within {TIMEOUT}s (deadlock?)\n{log[-4000:]}"
    assert code == 0, f"{config}: exit code {code}\n{log[-4000:]}"
    if config != "ddp.yaml":  # plain ddp leaves the gloo group to interpreter exit, which can abort (see strategy.py)
        assert "terminate called" not in log, f"{config}: a rank aborted at exit\n{log[-4000:]}"

    rows = _metrics(tmp_path)
    assert _last(rows, "val_acc") > 0.5, "validation accuracy near chance (0.1): training or averaging is broken"
    checkpoints = list(tmp_path.rglob("*.ckpt"))
    assert len(checkpoints) == 1, checkpoints
    checkpoint = torch.load(checkpoints[0], map_location="cpu", weights_only=False)
    if config == "ddp.yaml":
        assert "oscars" not in checkpoint
        assert not any(k.startswith("oscars/") for k in rows[0])
        return
    # The ScheduleMonitor's per-round metrics reached the CSV logger, and the fast rank trained more.
    tau_fast, tau_slow = _last(rows, "oscars/tau/rank0"), _last(rows, "oscars/tau/rank1")
    assert tau_fast > tau_slow, (tau_fast, tau_slow)
    # The schedule stored in the checkpoint (possibly re-solved at the last round) favours the fast rank too.
    saved = checkpoint["oscars"]["local_steps"]
    assert len(saved) == 2 and saved[0] > saved[1], saved
    assert "oscars:" in log and "final tau per rank" in log  # the end-of-fit summary
