"""2-rank runs (gloo on CPU) through Lightning's subprocess launcher, one per scenario.

Every run has a hard timeout: a deadlock fails the test in seconds instead of hanging CI. Rank 1 is emulated
3x slower in every scenario unless stated otherwise."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
TIMEOUT = 150


def _start_case(case: str, out: Path, timeout: int, extra_env: dict | None) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    # An in-process Trainer earlier in the session leaves rendezvous variables behind; start each run clean.
    leaked = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in leaked and not k.startswith("PL_")}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", OSCARS_TEST_DUMP_AFTER=str(timeout - 20))
    env.update(extra_env or {})
    return subprocess.Popen(
        [sys.executable, str(HERE / "run_case.py"), case, str(out)],
        cwd=out,  # Lightning's default_root_dir: a failed case's recovery point stays in its own directory
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        text=True,
    )


def _finish_case(proc: subprocess.Popen, case: str, out: Path, timeout: float, ranks: tuple[int, ...]) -> list[dict]:
    try:
        log, _ = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"case {case!r} did not finish within its timeout (deadlock?)\n{log[-4000:]}")
    (out / "launcher.log").write_text(log)
    results = []
    for rank in ranks:
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result (exit code {proc.returncode})\n{log[-4000:]}"
        results.append(json.loads(path.read_text()))
    _assert_group_gone(proc.pid, case)
    return results


def run_case(
    case: str, out: Path, timeout: int = TIMEOUT, extra_env: dict | None = None, ranks: tuple[int, ...] = (0, 1)
) -> list[dict]:
    return _finish_case(_start_case(case, out, timeout, extra_env), case, out, timeout, ranks)


def run_cases_in_pairs(cases: list[tuple[str, Path]], timeout: int = TIMEOUT) -> None:
    """Launch independent cases two at a time (four processes on two cores: their ranks mostly sleep or wait),
    each with its own timeout; results stay in each case's directory (read them with :func:`case_results`)."""
    run_chains([[case] for case in cases], at_once=2, timeout=timeout)


def run_chains(chains: list[list[tuple[str, Path]]], at_once: int, timeout: int = TIMEOUT) -> None:
    """Launch chains of cases, ``at_once`` chains at a time; a chain's cases run one after the other (a resume after
    the run it resumes: before each next case, the last one's ``rank*.json`` become ``first_rank*.json``)."""
    from concurrent.futures import ThreadPoolExecutor

    def run_chain(chain: list[tuple[str, Path]]) -> None:
        for k, (case, out) in enumerate(chain):
            if k:
                for rank in (0, 1):
                    (out / f"rank{rank}.json").rename(out / f"first_rank{rank}.json")
            _finish_case(_start_case(case, out, timeout, None), case, out, timeout, ())

    with ThreadPoolExecutor(max_workers=at_once) as pool:
        for done in [pool.submit(run_chain, chain) for chain in chains]:
            done.result()  # a chain's failure (pytest.fail) is raised here


def case_results(case: str, out: Path, ranks: tuple[int, ...] = (0, 1)) -> list[dict]:
    """The results a case launched by :func:`run_cases_in_pairs` wrote (a rank that wrote none fails the test)."""
    results = []
    for rank in ranks:
        path = out / f"rank{rank}.json"
        if not path.exists():
            log = (out / "launcher.log").read_text() if (out / "launcher.log").exists() else ""
            pytest.fail(f"rank {rank} wrote no result for {case}; its log ends:\n{log[-6000:]}")
        results.append(json.loads(path.read_text()))
    return results


def _first_averaging_from(history: list[dict], step: int) -> int:
    return min(h["global_step"] for h in history if h["global_step"] >= step)


def _assert_group_gone(pgid: int, case: str, grace: float = 15.0) -> None:
    """Nothing of the run may outlive it (a few seconds for orphans to be reaped)."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(pgid, signal.SIGKILL)
    pytest.fail(f"case {case!r} left processes running {grace:.0f} s after it ended")


# Independent cases that need nothing but their result files: fitted one after another in one launch per batch
# (the launch and the imports cost more than most of these fits), on first use, and shared by their tests.
BATCHES = {
    "features": (
        "by_name",
        "gossip_fixture",
        "alg1_samples",
        "local_sgd",
        "pinned",
        "val_float",
        "val_int",
        "check_val_every_n_epoch",
        "limit_float",
        "limit_int",
        "accumulate",
        "clip",
        "bf16",
        "sched_step",
        "sched_epoch",
        "sync_dist_epoch",
        "early_stopping",
        "manual_one",
        "manual_two",
        "max_steps",
        "max_time",
        "eval_after_fit",
        "warmup_too_long",
        "checkpoint",
        "loggers",
    ),
    "rounds": (
        "basic",
        "rebalance",
        "deadline",
        "timed_warmup",
        "fixed_warmup",
        "ripples_max_time",
        "ssp_max_time",
        "overlap",
        "overlap_max_time",
    ),
    "paradigms": ("ps_ssp", "ps_dssp", "ps_asp", "ps_dasp", "ripples_smart", "ripples_random", "ripples_overlap"),
    # test_lightning_features.py's: ordinary Lightning idioms (issue 29); the refused one last
    "drop_in": (
        "metric_rare",
        "monitor_step_value",
        "lr_find",
        "epoch_mean",
        "limit_quarter",
        "swa_batchnorm",
        "two_loaders",
    ),
    "lightning": (
        "accumulation",
        "weighted_sampler",
        "swa_and_accumulation",
        "optimizer_state_unused_head",
        "optimizer_state_lbfgs",
        "fast_dev_run",
        "slow_checkpoint_write",
        "builtin_callbacks",
    ),
    # Fits refused at setup with a clear error (no collective has run): each leaves the process group as it was.
    "refused": ("iterable", "tiny_dataset", "batch_size_finder"),
}
BATCHED = {case: batch for batch, cases in BATCHES.items() for case in cases}
# Batches run as two launches at once (their cases assert no speed ratio, so sharing the cores does not matter).
SPLIT_BATCHES = ("features",)
_case_dirs: dict[str, Path] = {}


def _batched(case: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    batch = BATCHED[case]
    if case not in _case_dirs:
        cases = BATCHES[batch]
        out = tmp_path_factory.mktemp(f"batch_{batch}")
        parts = [cases[0::2], cases[1::2]] if batch in SPLIT_BATCHES else [cases]
        launches = [("+".join(part), out / f"part{k}") for k, part in enumerate(parts)]
        run_cases_in_pairs(launches, timeout=TIMEOUT + 15 * max(len(part) for part in parts))
        for (_, part_dir), part in zip(launches, parts):
            _case_dirs.update(dict.fromkeys(part, part_dir))
    results = []
    for rank in (0, 1):
        path = _case_dirs[case] / case / f"rank{rank}.json"
        if not path.exists():  # the batch stopped at or before this case: show why (CI keeps no files)
            log = (_case_dirs[case] / "launcher.log").read_text()
            pytest.fail(f"rank {rank} wrote no result for {case} in batch {batch!r}; its log ends:\n{log[-6000:]}")
        results.append(json.loads(path.read_text()))
    return results


def case_dir(case: str) -> Path:
    """Where a batched case wrote its files (its batch must have run: ``finished`` or ``refused`` first)."""
    return _case_dirs[case] / case


def refused(case: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The case's two results from its batch's shared run, where ``fit`` raised (the test checks the error)."""
    return _batched(case, tmp_path_factory)


def finished(case: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory | None = None) -> list[dict]:
    """The case's two results, checked: no error, equal weights and steps on both ranks. A case of ``BATCHED``
    (pass ``tmp_path_factory``) comes from its batch's shared run."""
    if case in BATCHED and tmp_path_factory is not None:
        results = _batched(case, tmp_path_factory)
    else:
        results = run_case(case, tmp_path)
    return _checked(results)


def test_basic_balance_coverage_and_one_collective_per_round(tmp_path, tmp_path_factory):
    fast, slow = finished("basic", tmp_path, tmp_path_factory)
    # The fast rank trains more (the emulated speeds are 3x apart; how much more is the benchmarks' to measure).
    assert fast["steps_taken"] > slow["steps_taken"]
    assert fast["schedule"][0] > fast["schedule"][1]
    # Every sample exactly once per epoch: 2 epochs of 512.
    assert fast["seen"] + slow["seen"] == 2 * 512
    # Within training epochs, the only collective is the round's all-reduce.
    assert fast["collectives"] == slow["collectives"] > 0
    assert fast["collectives"] <= fast["num_averagings"]
    assert all(len(h["local_steps"]) == 2 for h in fast["history"])


def test_registered_by_name(tmp_path, tmp_path_factory):
    fast, slow = finished("by_name", tmp_path, tmp_path_factory)
    assert fast["num_averagings"] > 0 and fast["steps_taken"] > slow["steps_taken"]


def test_a_scheme_written_outside_the_package_trains(tmp_path, tmp_path_factory):
    # tests/gossip_fixture.py: a scheme that carries no control data, so the fit session sums it itself.
    fast, slow = finished("gossip_fixture", tmp_path, tmp_path_factory)  # equal weights: the pair is both ranks
    assert fast["seen"] + slow["seen"] == 1024, "every sample once per epoch"
    assert fast["num_averagings"] > 1 and fast["steps_taken"] > slow["steps_taken"], "balanced rounds"
    assert fast["scheme_meetings"] == slow["scheme_meetings"] == fast["num_averagings"]


def test_alg1_sample_weighted_with_optimizer_state(tmp_path, tmp_path_factory):
    fast, slow = finished("alg1_samples", tmp_path, tmp_path_factory)
    assert fast["seen"] + slow["seen"] == 1024
    assert fast["steps_taken"] > slow["steps_taken"]


def test_fixed_period_local_sgd_baseline_is_uniform(tmp_path, tmp_path_factory):
    fast, slow = finished("local_sgd", tmp_path, tmp_path_factory)
    assert fast["schedule"] == [16, 16]
    assert abs(fast["steps_taken"] - slow["steps_taken"]) <= 1


def test_pinned_local_steps(tmp_path, tmp_path_factory):
    fast, slow = finished("pinned", tmp_path, tmp_path_factory)
    assert all(h["local_steps"] == [3, 1] for h in fast["history"])
    assert fast["seen"] == 3 * slow["seen"]


def test_rebalances_after_midrun_slowdown(tmp_path, tmp_path_factory):
    fast, _ = finished("rebalance", tmp_path, tmp_path_factory)
    history = fast["history"]
    before = [h for h in history if h["local_steps"][0] == h["local_steps"][1]]
    after = [h for h in history if h["local_steps"][0] >= 2 * h["local_steps"][1]]
    assert before, "ranks should start balanced at equal speeds"
    assert after, f"no re-balance after rank 1 turned 3x slower: {[h['local_steps'] for h in history]}"
    # Within a few rounds of the first round that saw the slowdown.
    slow_seen = next(i for i, h in enumerate(history) if h["step_times"][1] > 2 * h["step_times"][0])
    first_rebalanced = next(i for i, h in enumerate(history) if h["local_steps"][0] >= 2 * h["local_steps"][1])
    assert first_rebalanced - slow_seen <= 3


@pytest.mark.parametrize("case", ["max_steps"])
def test_max_steps(case, tmp_path, tmp_path_factory):
    fast, slow = finished(case, tmp_path, tmp_path_factory)
    assert fast["global_step"] == 23


def test_max_time(tmp_path, tmp_path_factory):
    fast, slow = finished("max_time", tmp_path, tmp_path_factory)
    assert fast["epoch"] < 999


def test_val_check_interval_float(tmp_path, tmp_path_factory):
    fast, _ = finished("val_float", tmp_path, tmp_path_factory)
    assert "val_loss" in fast["metrics"]
    _rounds_end_at_validations(fast)


def _rounds_end_at_validations(result: dict) -> None:
    """Every epoch's plan knew where Lightning would validate (mid-epoch), and its rounds end there: the averaging
    before validation closed a round rather than cutting one. Also in the epochs after one re-sized mid-epoch."""
    last = max(epoch for epoch, _ in result["validated_at"])
    per_epoch = result["round_ends_per_epoch"]
    assert len(per_epoch) == last + 1
    for epoch, ends in enumerate(per_epoch):
        inside = [done for e, done in result["validated_at"] if e == epoch and done < ends[-1]]
        assert inside and set(inside) <= set(ends), (epoch, inside, ends)


def test_val_check_interval_int(tmp_path, tmp_path_factory):
    fast, slow = finished("val_int", tmp_path, tmp_path_factory)
    assert "val_acc" in fast["metrics"]
    # Every 7 batches (slots) of every epoch, on both ranks alike.
    assert fast["validated_at"] == slow["validated_at"] and fast["validated_at"]
    assert all(done % 7 == 0 for _, done in fast["validated_at"]), fast["validated_at"]
    for epoch, ends in enumerate(fast["round_ends_per_epoch"]):
        assert [d for e, d in fast["validated_at"] if e == epoch] == list(range(7, ends[-1] + 1, 7))


def test_check_val_every_n_epoch(tmp_path, tmp_path_factory):
    fast, slow = finished("check_val_every_n_epoch", tmp_path, tmp_path_factory)
    assert "val_loss" in fast["metrics"]
    assert fast["validations_per_epoch"] == slow["validations_per_epoch"] == [0, 1, 0, 1]  # epochs 2 and 4


def test_limit_train_batches_float(tmp_path, tmp_path_factory):
    # 512 samples in batches of 16: ddp gives each rank 16 batches; half of them on 2 ranks is 256 samples an epoch.
    fast, slow = finished("limit_float", tmp_path, tmp_path_factory)
    assert [a + b for a, b in zip(fast["seen_per_epoch"], slow["seen_per_epoch"])] == [256, 256]


def test_limit_train_batches_int(tmp_path, tmp_path_factory):
    # An int caps the epoch's batches as Lightning counts them on every rank: 9 slots an epoch, each trained by the
    # ranks whose slot it is (rank 1 is 3x slower: fewer samples than ddp's 2 x 9 batches).
    fast, slow = finished("limit_int", tmp_path, tmp_path_factory)
    assert fast["global_step"] == 18
    assert [a + b for a, b in zip(fast["seen_per_epoch"], slow["seen_per_epoch"])] <= [288, 288]
    assert fast["validations_per_epoch"] == [1, 1]


def test_accumulate_grad_batches(tmp_path, tmp_path_factory):
    fast, slow = finished("accumulate", tmp_path, tmp_path_factory)
    assert fast["seen"] + slow["seen"] == 1024


def test_gradient_clip_val(tmp_path, tmp_path_factory):
    for rank in finished("clip", tmp_path, tmp_path_factory):
        norms = rank["grad_norms"]
        assert len(norms) == rank["steps_taken"]  # every real step clipped, no-op slots none
        assert any(before > 0.5 for before, _ in norms), "some gradient needed clipping"
        assert all(after <= 0.5 + 1e-4 for _, after in norms), max(after for _, after in norms)


def test_bf16_mixed(tmp_path, tmp_path_factory):
    for rank in finished("bf16", tmp_path, tmp_path_factory):
        assert rank["step_dtypes"] and set(rank["step_dtypes"]) == {"torch.bfloat16"}


def test_step_interval_lr_scheduler(tmp_path, tmp_path_factory):
    fast, slow = finished("sched_step", tmp_path, tmp_path_factory)
    assert fast["lr"] == slow["lr"] and fast["lr"][0] < 0.1


def test_epoch_interval_lr_scheduler(tmp_path, tmp_path_factory):
    fast, slow = finished("sched_epoch", tmp_path, tmp_path_factory)
    assert fast["lr"] == slow["lr"] == [0.025]


def test_sync_dist_on_epoch(tmp_path, tmp_path_factory):
    fast, slow = finished("sync_dist_epoch", tmp_path, tmp_path_factory)
    assert fast["metrics"]["epoch_loss"] == pytest.approx(slow["metrics"]["epoch_loss"])


def test_model_checkpoint(tmp_path, tmp_path_factory):
    finished("checkpoint", tmp_path, tmp_path_factory)
    out = case_dir("checkpoint")
    assert (out / "best" / "last.ckpt").exists()
    assert len(list((out / "best").glob("*.ckpt"))) == 3  # top-2 + last
    assert len(list((out / "steps").glob("*.ckpt"))) >= 5


def test_early_stopping(tmp_path, tmp_path_factory):
    fast, _ = finished("early_stopping", tmp_path, tmp_path_factory)
    assert fast["epoch"] < 29


def test_loggers_lr_monitor_progress_bar(tmp_path, tmp_path_factory):
    fast, _ = finished("loggers", tmp_path, tmp_path_factory)
    out = case_dir("loggers")
    metrics = next((out / "csv").rglob("metrics.csv")).read_text()
    assert "train_loss_step" in metrics and "lr-SGD" in metrics
    assert list((out / "tb").rglob("events.out.tfevents.*"))
    # The schedule monitor logged every round through the same loggers, one row per round.
    header, *rows = metrics.splitlines()
    columns = header.split(",")
    for name in (
        "oscars/tau/rank0",
        "oscars/tau/rank1",
        "oscars/period_s",
        "oscars/allreduce_s",
        "oscars/idle_s/rank1",
    ):
        assert name in columns, name
    tau1 = columns.index("oscars/tau/rank1")
    logged = [row.split(",") for row in rows if row.split(",")[tau1]]
    assert len(logged) == len(fast["history"])
    assert [int(float(r[tau1])) for r in logged] == [h["local_steps"][1] for h in fast["history"]]
    # At the end of fit the monitor drew the schedule: a PNG beside the CSV logger's files, a figure in TensorBoard.
    (picture,) = (out / "csv").rglob("oscars_timeline.png")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in (out / "tb").rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events), size_guidance={"images": 0})
    accumulator.Reload()
    assert "oscars/timeline" in accumulator.Tags()["images"]


def test_manual_optimization_one_optimizer(tmp_path, tmp_path_factory):
    fast, slow = finished("manual_one", tmp_path, tmp_path_factory)
    assert fast["steps_taken"] > slow["steps_taken"]
    # A scheduler stepped in on_train_batch_end (called on no-op slots too) follows global_step on every rank.
    assert fast["lr"] == slow["lr"] == [pytest.approx(0.05 * 0.5 ** (fast["global_step"] // 10))]


def test_manual_optimization_two_optimizers(tmp_path, tmp_path_factory):
    fast, slow = finished("manual_two", tmp_path, tmp_path_factory)
    assert fast["steps_taken"] > slow["steps_taken"]


def test_validate_test_predict_after_fit(tmp_path, tmp_path_factory):
    fast, slow = finished("eval_after_fit", tmp_path, tmp_path_factory)
    assert fast["validate"][0]["val_acc"] == pytest.approx(slow["validate"][0]["val_acc"])
    assert fast["test"][0]["test_acc"] > 0.3  # 4 classes: chance is 0.25
    assert fast["predicted"] > 0


@pytest.fixture(scope="module")
def resumable(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """One run of ``resume_first`` (its directory, with the checkpoint, and its results), shared by the tests that
    resume from it; each resumes in a copy of the directory (``resumed_from``)."""
    out = tmp_path_factory.mktemp("resume_first")
    return out, finished("resume_first", out)


def resumed_from(resumable: tuple[Path, list[dict]], tmp_path: Path) -> list[dict]:
    """Copy the shared first run into ``tmp_path`` (a resume writes its own checkpoints there); its results."""
    import shutil

    out, first = resumable
    shutil.copytree(out, tmp_path, dirs_exist_ok=True)
    return first


@pytest.fixture(scope="module")
def resumes(resumable: tuple[Path, list[dict]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``resume_second`` and ``resume_swapped``, each in its own copy of the first run, two at a time."""
    dirs = {case: tmp_path_factory.mktemp(case) for case in ("resume_second", "resume_swapped")}
    for out in dirs.values():
        resumed_from(resumable, out)
    run_cases_in_pairs(list(dirs.items()))
    return dirs


@pytest.fixture(scope="module")
def exact_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[dict]]]:
    """The pinned-speed runs: the reference ``exact_a``, its repeat ``exact_b`` and a run preempted by SIGTERM
    (``preempt_first``), two at a time; then ``preempt_resume`` in the preempted run's directory."""
    dirs = {case: tmp_path_factory.mktemp(case) for case in ("exact_a", "exact_b", "preempt_first")}
    chains = [[("exact_a", dirs["exact_a"])], [("exact_b", dirs["exact_b"])]]
    chains.insert(0, [("preempt_first", dirs["preempt_first"]), ("preempt_resume", dirs["preempt_first"])])
    run_chains(chains, at_once=3)  # pinned speeds: the runs' schedules do not depend on how fast they go
    runs = {case: (out, case_results(case, out)) for case, out in dirs.items() if case != "preempt_first"}
    out = dirs["preempt_first"]
    runs["preempt_first"] = (out, _renamed_results("preempt_first", out))
    runs["preempt_resume"] = (out, case_results("preempt_resume", out))
    return runs


@pytest.fixture(scope="module")
def exact_a(exact_runs: dict[str, tuple[Path, list[dict]]]) -> list[dict]:
    """The pinned-speed reference run, shared by the reproducibility and the preemption tests."""
    return _checked(exact_runs["exact_a"][1])


def _checked(results: list[dict]) -> list[dict]:
    """As :func:`finished` checks a run: no error, equal weights and steps on both ranks."""
    for r in results:
        assert "error" not in r, r["error"]
    assert results[0]["weights"] == results[1]["weights"], "ranks ended with different weights"
    assert results[0]["global_step"] == results[1]["global_step"]
    return results


# Mid-epoch resumes: every first run (which writes a checkpoint mid-epoch), then its second run (which resumes from it
# in the same directory), three such chains at a time.
PREMOVE_CHECKPOINT = Path(__file__).parent / "data" / "premove_midepoch.ckpt"
MIDEPOCH = ("midepoch", "deadline_midepoch", "ripples_midepoch", "ssp_midepoch", "overlap_midepoch")


@pytest.fixture(scope="module")
def midepoch_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[dict], list[dict]]]:
    """Per name of ``MIDEPOCH``: its directory, the first run's results and the resumed run's (each resume starts as
    soon as its first run ended, two chains at a time)."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in MIDEPOCH}
    chains = [[(f"{name}_first", out), (f"{name}_second", out)] for name, out in dirs.items()]
    # And a resume from a checkpoint an older release wrote (midepoch_first at 0.1.0, before the sub-packages).
    premove = tmp_path_factory.mktemp("premove")
    (premove / "steps").mkdir()
    shutil.copy(PREMOVE_CHECKPOINT, premove / "steps" / "epoch=0-step=5.ckpt")
    run_chains([*chains, [("midepoch_second", premove)]], at_once=3)
    runs = {
        name: (out, _renamed_results(f"{name}_first", out), case_results(f"{name}_second", out))
        for name, out in dirs.items()
    }
    runs["premove"] = (premove, [], case_results("midepoch_second", premove))
    return runs


def _renamed_results(case: str, out: Path) -> list[dict]:
    """The results of a chain's first run, renamed ``first_rank*.json`` when the next case started."""
    return [json.loads((out / f"first_rank{rank}.json").read_text()) for rank in (0, 1)]


# Injected failures and signals: the survivors mostly wait for a timeout or a peer's report, and the signalled runs
# are short, so they share one launch pool, two runs at a time (at three, start-up once outran the failure cases'
# 8-9 s rendezvous timeouts in CI; no case asserts a speed ratio).
FAILURES = ("raise_rank1", "hang_rank1", "kill_rank1", "ps_raise_rank1", "ripples_raise_rank1")
SIGNALS = (
    "sigterm_rank0",
    "sigterm_rank1",
    "requeue",
    "ripples_sigterm",
    "ssp_sigterm",
    "overlap_sigterm",
    "ripples_time_checkpoint",
)


@pytest.fixture(scope="module")
def stop_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {case: tmp_path_factory.mktemp(case) for case in FAILURES + SIGNALS}
    run_chains([[(case, out)] for case, out in dirs.items()], at_once=2)
    return dirs


@pytest.fixture(scope="module")
def failure_runs(stop_runs: dict[str, Path]) -> dict[str, Path]:
    return stop_runs


@pytest.fixture(scope="module")
def signal_runs(stop_runs: dict[str, Path]) -> dict[str, Path]:
    return stop_runs


def test_checkpoint_resume(resumable, resumes):
    first = resumable[1]
    second = _checked(case_results("resume_second", resumes["resume_second"]))
    assert second[0]["epoch"] == 2
    assert second[0]["global_step"] > first[0]["global_step"]
    # The schedule was restored, not re-profiled: no warm-up round after resuming.
    assert all(h["local_steps"][0] > h["local_steps"][1] for h in second[0]["history"])
    # Each rank restored its own step-time estimate (rank 1 used to take rank 0's and report ~2x, not ~3x): the
    # ranks' ratio after resuming is the one the first fit ended with, not pulled towards 1.
    times, before = second[0]["history"][0]["step_times"], first[0]["history"][-1]["step_times"]
    assert times[1] / times[0] > 0.8 * before[1] / before[0], (times, before)


def test_iterable_dataset_fails_clearly(tmp_path_factory):
    results = refused("iterable", tmp_path_factory)
    assert all("IterableDataset" in r.get("error", "") for r in results)


@pytest.mark.parametrize("receiver", [0, 1])
def test_sigterm_stops_all_ranks_at_a_round_boundary(receiver, signal_runs):
    tmp_path = signal_runs[f"sigterm_rank{receiver}"]
    results = case_results(f"sigterm_rank{receiver}", tmp_path)
    for r in results:
        assert "SIGTERMException" in r.get("error", ""), r.get("error")
    fast, slow = results
    # Both ranks stopped at the same batch, soon after the signal (within a round), with averaged weights.
    assert fast["global_step"] == slow["global_step"]
    # ... the first round boundary at or after the signal (step 7): the flag rides on that round's all-reduce.
    assert fast["global_step"] == _first_averaging_from(fast["history"], 7)
    assert fast["weights"] == slow["weights"]
    assert fast["epoch"] < 4
    # OnExceptionCheckpoint wrote the preemption checkpoint, with the schedule in it.
    import torch

    checkpoint = torch.load(tmp_path / "preempt" / "on_exception.ckpt", weights_only=False)
    assert checkpoint["global_step"] == fast["global_step"]
    assert checkpoint["oscars"]["local_steps"] == fast["schedule"]


def test_requeue_signal_handler_runs_on_every_rank_at_one_round_boundary(signal_runs):
    tmp_path = signal_runs["requeue"]
    fast, slow = _checked(case_results("requeue", tmp_path))  # rank 1 alone got SIGUSR1; a checkpoint in the handler
    assert fast["handled_at"] == slow["handled_at"] and len(fast["handled_at"]) == 1
    step = fast["handled_at"][0]
    assert step == _first_averaging_from(fast["history"], 7)
    assert (tmp_path / f"requeue-{step}.ckpt").exists()


def test_resume_mid_epoch_uses_every_sample_once(midepoch_runs):
    out, first, second = midepoch_runs["midepoch"]
    first, second = _checked(first), _checked(second)
    assert (out / "steps" / "epoch=0-step=5.ckpt").exists()
    assert second[0]["global_step"] == first[0]["global_step"]
    assert second[0]["epoch"] == first[0]["epoch"] == 2
    before = sum(r["seen_at"]["5"] for r in first)
    after = sum(r["seen"] for r in second)
    assert before > 0
    # The resumed run trains on exactly the rest of epoch 0 and all of epoch 1: nothing lost, nothing repeated.
    assert before + after == 2 * 512


def test_a_checkpoint_written_before_the_sub_packages_resumes_and_uses_every_sample_once(midepoch_runs):
    """``tests/data/premove_midepoch.ckpt``: ``midepoch_first``'s checkpoint at step 5, written by 0.1.0 when every
    module sat at the package's root. It resumes mid-epoch where it stopped, its round plan restored."""
    written = json.loads(PREMOVE_CHECKPOINT.with_suffix(".json").read_text())
    _, _, second = midepoch_runs["premove"]
    second = _checked(second)
    assert second[0]["epoch"] == written["final_epoch"] and second[0]["global_step"] == written["final_global_step"]
    assert sum(written["trained_before_step_5"]) + sum(r["seen"] for r in second) == 2 * 512


def test_resume_with_a_different_heterogeneity_rebalances(resumes):
    fast, slow = _checked(case_results("resume_swapped", resumes["resume_swapped"]))
    assert fast["epoch"] == 3
    # The restored schedule favoured rank 0; now rank 0 is the slow one and the schedule follows.
    assert fast["history"][0]["local_steps"][0] > fast["history"][0]["local_steps"][1]
    assert fast["schedule"][1] > fast["schedule"][0]
    assert slow["seen"] > fast["seen"] / 2


def test_resume_two_ranks_on_one_and_one_on_two(tmp_path, resumable):
    import lightning as L
    from toy import ToyModule

    import lightning_oscars  # noqa: F401 - registers "oscars"

    resumed_from(resumable, tmp_path)
    two_rank_ckpt = tmp_path / "ckpt" / "last.ckpt"
    # 2 -> 1: the checkpoint's schedule is for 2 ranks; on one device training just continues.
    module = ToyModule()
    trainer = L.Trainer(
        strategy="oscars",
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path / "one",
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "one", save_last=True)],
    )
    trainer.fit(module, ckpt_path=two_rank_ckpt)
    assert trainer.current_epoch == 2 and module.seen == 512
    # 1 -> 2: a single-device checkpoint resumed on 2 ranks profiles from scratch and balances.
    results = run_case(
        "resume_from_env", tmp_path / "two", extra_env={"OSCARS_TEST_CKPT": str(tmp_path / "one" / "last.ckpt")}
    )
    fast, slow = results
    assert "error" not in fast, fast["error"]
    assert fast["weights"] == slow["weights"] and fast["epoch"] == 3
    assert fast["history"][0]["local_steps"] == [2, 2]  # warm-up round: fresh profiling
    assert fast["schedule"][0] > fast["schedule"][1]
    assert fast["seen"] + slow["seen"] == 512


def test_warmup_longer_than_max_steps_shrinks_to_the_run(tmp_path, tmp_path_factory):
    fast, slow = finished("warmup_too_long", tmp_path, tmp_path_factory)  # warmup_steps=8, max_steps=5
    assert fast["global_step"] == slow["global_step"] == 5
    assert fast["history"][0]["local_steps"] == [5, 5]


def test_dataset_smaller_than_one_step_per_rank_fails_clearly(tmp_path_factory):
    results = refused("tiny_dataset", tmp_path_factory)
    for r in results:
        assert "fewer than one optimizer step for each of the 2 ranks" in r.get("error", ""), r.get("error")


def test_same_seed_and_pinned_speeds_give_identical_runs(exact_a, exact_runs):
    a = exact_a
    b = _checked(exact_runs["exact_b"][1])
    assert [h["local_steps"] for h in a[0]["history"]] == [h["local_steps"] for h in b[0]["history"]]
    assert a[0]["weights"] == b[0]["weights"]  # bit-identical on CPU
    assert a[0]["schedule"] == [3, 1]


def test_preempted_run_resumes_to_the_uninterrupted_weights(exact_a, exact_runs):
    reference = exact_a
    stopped = exact_runs["preempt_first"][1]
    assert all("SIGTERMException" in r.get("error", "") for r in stopped)
    assert stopped[0]["weights"] == stopped[1]["weights"]
    resumed = _checked(exact_runs["preempt_resume"][1])
    assert 20 <= stopped[0]["global_step"] < reference[0]["global_step"]
    assert resumed[0]["global_step"] == reference[0]["global_step"]
    # Nothing lost, nothing repeated, and the same trajectory: bit-identical final weights.
    assert sum(r["seen"] for r in stopped) + sum(r["seen"] for r in resumed) == sum(r["seen"] for r in reference)
    assert resumed[0]["weights"] == reference[0]["weights"]


def test_a_rank_that_raises_is_named_by_the_others(failure_runs):
    survivor, failed = case_results("raise_rank1", failure_runs["raise_rank1"])
    assert "injected failure in training_step" in failed["error"]
    assert "Rank 1 failed: ValueError: injected failure in training_step" in survivor["error"], survivor["error"]
    assert survivor["error_after_s"] < 30


def test_a_rank_that_raises_is_named_by_a_worker_waiting_for_it_on_the_server(failure_runs):
    survivor, failed = case_results("ps_raise_rank1", failure_runs["ps_raise_rank1"])
    assert "injected failure in training_step" in failed["error"]
    assert "Rank 1 failed: ValueError: injected failure in training_step" in survivor["error"], survivor["error"]
    assert survivor["error_after_s"] < 30


def test_a_rank_that_raises_is_named_by_a_worker_waiting_for_it_in_a_ripples_group(failure_runs):
    survivor, failed = case_results("ripples_raise_rank1", failure_runs["ripples_raise_rank1"])
    assert "injected failure in training_step" in failed["error"]
    assert "ank 1" in survivor["error"], survivor["error"]
    assert survivor["error_after_s"] < 30


def test_a_hung_rank_is_named_after_the_collective_timeout(failure_runs):
    survivor, _ = case_results("hang_rank1", failure_runs["hang_rank1"])
    # Rank 1 hangs inside a step until rank 0 has reported (at most 25 s): rank 0 gives up after the 8 s collective
    # timeout, not after the hang.
    assert "Rank(s) 1 did not reach this round" in survivor["error"], survivor["error"]
    assert survivor["error_after_s"] < 22


def test_a_killed_rank_is_reported_and_nothing_is_left_running(failure_runs):
    tmp_path = failure_runs["kill_rank1"]  # the launch failed if anything of the run outlived it
    survivor = tmp_path / "rank0.json"
    if survivor.exists():  # rank 0 saw the broken all-reduce first and named the missing rank
        error = json.loads(survivor.read_text())["error"]
        assert "Rank(s) 1 did not reach this round" in error, error
    else:  # Lightning's child-process observer got there first: it names the rank and kills the rest
        log = (tmp_path / "launcher.log").read_text()
        assert "[rank: 1] Child process" in log and "terminated with code -9" in log, log[-3000:]


@pytest.mark.extended
def test_soak_random_speed_changes_for_hundreds_of_rounds(tmp_path):
    """Outside the default run (``pytest -m extended``); CI runs it."""
    fast, slow = finished("soak", tmp_path)  # identical weights on both ranks, no hang (hard timeout)
    rounds = len(fast["history"])
    # Hundreds of rounds: 266 in 45 s on a 2-core CI VM with the 0.02 efficiency tolerance (longer rounds than 0.05).
    assert rounds >= 200, rounds
    assert sum(1 for h in fast["history"] if h["rebalanced"]) >= 3  # it kept adapting
    # Every completed epoch trained on every sample exactly once (the last epoch may be cut by max_time).
    completed = fast["seen_per_epoch"][:-1] if fast["epoch"] < 10_000 else fast["seen_per_epoch"]
    assert len(completed) >= 5
    for epoch, (a, b) in enumerate(zip(fast["seen_per_epoch"], slow["seen_per_epoch"])):
        if epoch < len(completed):
            assert a + b == 2048, (epoch, a, b)
    # Speed changes re-size epochs mid-way (re-solved schedules): validation still runs twice per epoch, no more.
    validations = fast["validations_per_epoch"][: len(completed)]
    assert validations == [2] * len(completed), validations
    print(f"soak: {rounds} rounds, {len(completed)} epochs, {fast['global_step']} steps")


def _epochs_complete(fast: dict, slow: dict, n: int) -> None:
    for epoch, (a, b) in enumerate(zip(fast["trained"], slow["trained"])):
        assert sorted(a + b) == list(range(n)), f"epoch {epoch}: every sample exactly once"


def test_deadline_rounds_follow_the_clock_and_train_every_sample_once(tmp_path, tmp_path_factory):
    fast, slow = finished("deadline", tmp_path, tmp_path_factory)  # identical weights, no hang
    assert len(fast["trained"]) == 3
    _epochs_complete(fast, slow, 480)
    solved = [h for h in fast["history"] if h["round"] > 1]
    trained = [tuple(s // 8 for s in h["samples"]) for h in solved]
    # Under jitter the steps a rank takes follow the deadline: they differ from the schedule's in some rounds.
    assert any(t != tuple(h["local_steps"]) for t, h in zip(trained, solved)), trained
    assert sum(len(a) for a in fast["trained"]) > 2 * sum(len(b) for b in slow["trained"])
    _rounds_end_at_validations(fast)  # deadline rounds too: shortened, their reservations and deadline scaled


def test_timed_warmup_keeps_the_fast_rank_training_while_the_slow_one_warms_up(tmp_path, tmp_path_factory):
    fast, slow = finished("timed_warmup", tmp_path, tmp_path_factory)  # identical weights, no hang
    _epochs_complete(fast, slow, 480)
    first = fast["history"][0]
    assert first["local_steps"] == [2, 2]
    fast_steps, slow_steps = (s // 8 for s in first["samples"])
    assert slow_steps == 2, "the slow rank takes its warm-up steps"
    assert 4 <= fast_steps <= 16, "the fast rank (3x) kept training meanwhile, within the round's 16 slots"
    assert fast["collectives"] == slow["collectives"] <= fast["num_averagings"], "no collective beyond the rounds'"
    fixed, _ = finished("fixed_warmup", tmp_path / "fixed", tmp_path_factory)
    assert [s // 8 for s in fixed["history"][0]["samples"]] == [2, 2]


def test_deadline_rounds_resume_mid_round_without_losing_or_repeating_data(midepoch_runs):
    out, first, second = midepoch_runs["deadline_midepoch"]
    first = _checked(first)
    assert (out / "steps" / "epoch=0-step=13.ckpt").exists()
    # What both ranks trained before the checkpoint (a cut in the middle of a deadline round), then the resumed run.
    before = [idx for r in first for step, batch in r["trained_steps"] if step < 13 for idx in batch]
    fast, slow = _checked(second)
    after = fast["trained"][0] + slow["trained"][0]
    assert sorted(before + after) == list(range(480)), "the resumed epoch trains exactly what was left"
    _epochs_complete({"trained": fast["trained"][1:]}, {"trained": slow["trained"][1:]}, 480)
    assert fast["epoch"] == first[0]["epoch"] == 3 and len(fast["trained"]) == 3


@pytest.mark.parametrize("case, bound", [("ps_ssp", 2), ("ps_dssp", 1 + 3)])
def test_ssp_and_dssp_on_the_in_job_server_keep_their_bound_and_lightning_semantics(
    case, bound, tmp_path, tmp_path_factory
):
    fast, slow = finished(case, tmp_path, tmp_path_factory)  # equal weights and global steps on both ranks, no hang
    _epochs_complete(fast, slow, 480)
    assert "val_loss" in fast["metrics"]
    for r in (fast, slow):
        assert r["ps"]["staleness"] and max(r["ps"]["staleness"]) <= bound, f"never more than {bound} ahead"
    assert fast["ps"]["held"] + slow["ps"]["held"] > 0, "the fast rank was held back at the bound"
    assert len(sum(fast["trained"], [])) > len(sum(slow["trained"], [])), "the faster rank took more of the data"


def test_asp_on_the_in_job_server_never_waits(tmp_path, tmp_path_factory):
    fast, slow = finished("ps_asp", tmp_path, tmp_path_factory)
    _epochs_complete(fast, slow, 480)
    assert fast["ps"]["held"] == slow["ps"]["held"] == 0
    assert max(fast["ps"]["staleness"] + slow["ps"]["staleness"]) >= 2, "the fast rank ran ahead"
    assert len(sum(fast["trained"], [])) > len(sum(slow["trained"], []))
    # Asked for, the time-boxed warm-up: the 3x faster rank keeps training while the slow one takes its 2 steps.
    warmup = [s // 8 for s in fast["history"][0]["samples"]]
    assert warmup[1] == 2 and warmup[0] > 2, warmup


@pytest.mark.parametrize("generator", ["smart", "random", "overlap"])
def test_ripples_groups_keep_lightning_semantics_and_smart_groups_spare_the_fast_rank(
    generator, tmp_path, tmp_path_factory
):
    fast, slow = finished(f"ripples_{generator}", tmp_path, tmp_path_factory)  # equal weights and global steps, no hang
    _epochs_complete(fast, slow, 480)
    assert "val_loss" in fast["metrics"]
    _rounds_end_at_validations(fast)
    fast_report, slow_report = fast["ripples"], slow["ripples"]
    assert fast_report["groups"] > 0 and slow_report["groups"] > 0, "one group per real step"
    for report in (fast_report, slow_report):  # overlap: exchanges applied after the next step, not at once
        assert (report["applied_late"] > 0) == (generator == "overlap")
    generator = "smart" if generator == "overlap" else generator  # overlap runs smart groups
    if generator == "smart":  # under random pairing both keep about one pace (CI once saw 58 against 62)
        assert fast_report["groups"] >= slow_report["groups"]
    met = fast_report["met"]  # rank 0 runs the generator: how often the two ranks averaged together
    assert met[0][1] == met[1][0] > 0
    if generator == "smart":
        # Pairs are made when one rank asks and the other is expected within a tenth of the asker's step: the
        # fast rank does not wait for the slow one, so it trains at its own pace (1.86-2.0x the slow one's alone,
        # where Lightning's own per-step work is not slowed down; 1.31x once in a full suite on a loaded machine;
        # in lockstep it would be 1x) and takes more of the data; every pair is a larger share of the slow rank's
        # groups.
        assert slow_report["mean_group_size"] > fast_report["mean_group_size"]
        assert len(sum(fast["trained"], [])) > 1.2 * len(sum(slow["trained"], []))
    else:  # a random division pairs them whenever the slow rank's buffer has room (one run: 1.32 and 1.94)
        assert slow_report["mean_group_size"] > 1.8 and fast_report["mean_group_size"] > 1.2


def test_dasp_moves_a_slow_rank_out_of_the_synchronous_group_and_back(tmp_path, tmp_path_factory):
    fast, slow = finished("ps_dasp", tmp_path, tmp_path_factory)
    _epochs_complete(fast, slow, 480)
    states = [state for r in (fast, slow) for _, worker, state in r["ps"]["switches"] if worker == 1]
    assert "async" in states and states[-1] == "sync", states


@pytest.mark.parametrize("paradigm", ["ripples", "ssp", "overlap"])
def test_step_synced_paradigms_resume_mid_epoch_without_losing_or_repeating_data(paradigm, midepoch_runs):
    out, first, second = midepoch_runs[f"{paradigm}_midepoch"]
    first = _checked(first)
    assert (out / "steps" / "epoch=0-step=13.ckpt").exists()
    before = [idx for r in first for step, batch in r["trained_steps"] if step < 13 for idx in batch]
    fast, slow = _checked(second)  # equal weights and steps on both ranks
    after = fast["trained"][0] + slow["trained"][0]
    assert sorted(before + after) == list(range(480)), "the resumed epoch trains exactly what was left"
    _epochs_complete({"trained": fast["trained"][1:]}, {"trained": slow["trained"][1:]}, 480)
    assert fast["epoch"] == first[0]["epoch"] == 3 and len(fast["trained"]) == 3


@pytest.mark.parametrize("paradigm", ["ripples", "ssp", "overlap"])
def test_step_synced_paradigms_stop_every_rank_at_one_round_boundary_on_sigterm(paradigm, signal_runs):
    import torch

    tmp_path = signal_runs[f"{paradigm}_sigterm"]
    results = case_results(f"{paradigm}_sigterm", tmp_path)  # rank 1 alone receives SIGTERM at step 7
    for r in results:
        assert "SIGTERMException" in r.get("error", ""), r.get("error")
    fast, slow = results
    assert fast["global_step"] == slow["global_step"] == _first_averaging_from(fast["history"], 7)
    assert fast["weights"] == slow["weights"], "one model at the stop: the round's global average"
    assert fast["epoch"] < 4
    checkpoint = torch.load(tmp_path / "preempt" / "on_exception.ckpt", weights_only=False)
    assert checkpoint["global_step"] == fast["global_step"]


@pytest.mark.parametrize("paradigm", ["ripples", "ssp", "overlap"])
def test_step_synced_paradigms_honour_max_time(paradigm, tmp_path, tmp_path_factory):
    fast, slow = finished(f"{paradigm}_max_time", tmp_path, tmp_path_factory)  # both stop, at one step
    assert 0 < fast["global_step"] and fast["epoch"] < 999
    assert len(sum(fast["trained"], [])) > len(sum(slow["trained"], [])), "the fast rank kept its pace"


def test_overlapped_averaging_reaches_the_models_late_yet_leaves_them_equal_where_lightning_looks(
    tmp_path, tmp_path_factory
):
    fast, slow = finished("overlap", tmp_path, tmp_path_factory)  # equal weights at the end, checked there
    _epochs_complete(fast, slow, 480)
    # Rounds ending inside an epoch were posted and applied one round late, so during the next round the models
    # held their own progress on top of an average still in flight...
    assert fast["applied_late"] == slow["applied_late"] > 0
    assert fast["settled"] == slow["settled"] and not all(fast["settled"])
    # ...but every validation (twice per epoch) saw one model on both ranks: the averaging before it was applied
    # at once.
    assert len(fast["at_validation"]) == 4
    assert fast["at_validation"] == slow["at_validation"]
    assert fast["num_averagings"] - fast["applied_late"] >= 4  # an averaging applied at once before each


def test_a_time_interval_checkpoint_is_refused_clearly_where_ranks_wait_inside_rounds(signal_runs):
    for r in case_results("ripples_time_checkpoint", signal_runs["ripples_time_checkpoint"]):
        assert "train_time_interval" in r.get("error", "") and "every_n_train_steps" in r["error"], r.get("error")
