"""Surviving a lost rank: the fit saves what the survivors have, and a restart of the same script goes on from it.

``recovery_case.py`` trains two epochs with rank 1 3x slower; rank 1 is SIGKILLed mid-epoch. Launched through
Lightning's own launcher in a restart loop (the user's script unchanged, no ``ckpt_path``). What the test asserts,
as the promise: the fit completes, every sample of every epoch is trained at least once, the only samples trained
twice are the dead rank's in the round it died in, the ranks end with identical weights, nothing hangs (each run has
a hard timeout), and no recovery point is left behind once the fit ended.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest
from recovery_checks import (
    CASE,
    TIMEOUT,
    Runs,
    assert_recovered,
    assert_steps_applied_once,
    finish,
    killed_pids,
    pids_by_last_step,
    rank_of,
    restored_step,
    run,
    srun,
    steps,
    torchrun,
    torchrun_env,
)
from subproc import clean_env, free_port, kill_group, start, wait_until_listening

pytestmark = pytest.mark.multiprocess


# The restart sequences are long runs (four or five launches each, restarts included): they run in the extended run,
# which CI runs after the default one; the continuation and the recovery points are unit-tested in the default run.
@pytest.fixture(scope="module")
def sequences(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Runs]]:
    """The three restart sequences below, run side by side (their ranks mostly sleep, as on a GPU; each sequence's
    runs one after the other): ``name -> (output directory, runs)``."""
    from concurrent.futures import ThreadPoolExecutor

    made = {
        "restart_loop": _restart_loop,
        "failures_everywhere": _failures_everywhere,
        "replicas": _replica_runs,
        "batch": _batch_balance_runs,
        "rank_sizes": _rank_batch_size_runs,
        "sharded": lambda out: _replica_runs(out, shard=True),
        "two_survivors": _two_survivor_runs,
    }
    with ThreadPoolExecutor(max_workers=4) as pool:  # they mostly sleep, as on a GPU; 4 at once on 2 cores
        futures = {name: pool.submit(run, tmp_path_factory.mktemp(name)) for name, run in made.items()}
        return {name: future.result() for name, future in futures.items()}


def _restart_loop(out: Path) -> tuple[Path, Runs]:
    """Lightning's launcher in a restart loop, deadline rounds (each rank trains until the round's deadline, its
    reservation settled at the averaging): 2 ranks, rank 1 killed at step 6 (the warm-up round); again 2 ranks,
    stopped by SIGTERM on rank 1 after step 10 (a preemption right after a recovery: every rank saves at the round
    boundary); 2 ranks, rank 1 killed at step 20 (the second epoch); then 2 ranks to the end."""
    runs = []
    for event in ("KILL=6", "SIGTERM=10", "KILL=20", None):
        seen = {int(p.stem.split("-")[1]) for p in out.glob("trained-*.jsonl")}
        env = clean_env(
            OSCARS_TEST_DUMP_AFTER=str(TIMEOUT - 20), OSCARS_TEST_MODEL="batchnorm", OSCARS_TEST_DEADLINE="1"
        )
        if event is not None:
            name, step = event.split("=")
            env[f"OSCARS_TEST_{name}"] = step
        # As torchrun --max-restarts=1 tells its ranks: a stop's recovery point is saved where an agent restarts them.
        env["TORCHELASTIC_MAX_RESTARTS"] = "1"
        code, log = run([sys.executable, CASE, str(out)], env)
        runs.append((code, log, killed_pids(out, seen) if event and event.startswith("KILL") else set()))
    return out, runs


@pytest.mark.extended
def test_a_restart_loop_around_lightnings_launcher_goes_on_after_each_lost_rank(sequences):
    out, runs = sequences["restart_loop"]
    (first, log1, _), (_, log2, _), (third, log3, _), (last, log4, _) = runs
    assert first != 0 and "This rank's state is saved in" in log1, log1[-3000:]
    assert third != 0 and "This rank's state is saved in" in log3, log3[-3000:]
    assert last == 0, log4[-3000:]
    # Each restart resumed from the point the run before it left: a newer one every time (the SIGTERM's included).
    points = [restored_step(log) for log in (log2, log3, log4)]
    assert None not in points and points == sorted(set(points)), points
    # The dead rank's processes: in each killed run, the rank-1 process (its record ends at the kill).
    killed: set[int] = set()
    for _, _, pids in (runs[0], runs[2]):
        last_steps = {pid: max(steps(out, pid)) for pid in pids}
        killed.add(min(last_steps, key=last_steps.__getitem__))  # the one that died first trained least far
    results = assert_recovered(out, killed, ranks=2)
    assert all(r["deadline_rounds"] for r in results), "the sequence runs deadline rounds"


def _failures_everywhere(out: Path) -> tuple[Path, Runs]:
    """Other shapes (a frozen layer, equal speeds, validation twice an epoch, a ModelCheckpoint every 5 steps) and
    other failure points, each run restarted: rank 1 killed at step 4 and rank 0 killed while writing its state (no
    complete point); rank 1 killed inside a validation; inside a checkpoint write; at the first batch of a restarted
    fit (a second failure in a row, before any round of it ended); then to the end."""
    shape = {"OSCARS_TEST_MODEL": "frozen", "OSCARS_TEST_SLOWDOWN": "1", "OSCARS_TEST_VALIDATE": "1"}
    events: list[dict[str, str]] = [
        {"OSCARS_TEST_KILL": "4", "OSCARS_TEST_DIE_SAVING": "1"},
        {"OSCARS_TEST_KILL_IN": "validation"},
        {"OSCARS_TEST_KILL_IN": "checkpoint"},
        {"OSCARS_TEST_KILL_IN": "first"},
        {},
    ]
    runs = []
    for event in events:
        seen = {int(p.stem.split("-")[1]) for p in out.glob("trained-*.jsonl")}
        env = clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT - 20), OSCARS_TEST_CHECKPOINT_EVERY="5", **shape, **event)
        env["PYTHONWARNINGS"] = "ignore,default:oscars"  # the strategy's own warnings are shown
        code, log = run([sys.executable, CASE, str(out)], env)
        new = {int(p.stem.split("-")[1]) for p in out.glob("trained-*.jsonl")} - seen
        # The processes whose work is lost: both of the first run (no complete point), rank 1's of the others.
        lost = new if "OSCARS_TEST_DIE_SAVING" in event else {pid for pid in new if rank_of(out, pid) == 1}
        runs.append((code, log, lost if event else set()))
    return out, runs


@pytest.mark.extended
def test_failures_inside_validation_checkpoint_writes_saving_and_twice_in_a_row_lose_only_the_dead_ranks_work(
    sequences,
):
    out, runs = sequences["failures_everywhere"]
    codes = [code for code, _, _ in runs]
    assert all(code != 0 for code in codes[:-1]) and codes[-1] == 0, [log[-3000:] for _, log, _ in runs]
    logs = [log for _, log, _ in runs]
    # Rank 0 died writing its state: the restart ignores the half-written point, says so, and starts afresh.
    assert "This rank's state is saved in" not in logs[0]
    assert "ignoring the recovery point" in logs[1] and restored_step(logs[1]) is None, logs[1][-3000:]
    # Every later failure (inside a validation, a checkpoint write, before a restarted fit's first round ended)
    # saved a point, and the next run resumed from it.
    for log in logs[1:4]:
        assert "This rank's state is saved in" in log, log[-3000:]
    points = [restored_step(log) for log in logs[2:]]
    assert None not in points and points == sorted(points), points
    results = assert_recovered(out, set().union(*(lost for _, _, lost in runs)), ranks=2)
    # Callback state is one state: the checkpoint bookkeeping agrees on every rank after three recoveries.
    states = [r["checkpoint_callback"] for r in results]
    assert states[0]["best_k_models"] and all(state == states[0] for state in states), states


def _replica_runs(out: Path, shard: bool = False) -> tuple[Path, Runs]:
    """Four ranks in two replicas of two (``replica_size=2``; with ``shard``, each replica's model sharded between
    its ranks), bf16 mixed precision; rank 2 is SIGKILLed mid-epoch; then to the end."""
    env = clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT - 20), OSCARS_TEST_DEVICES="4", OSCARS_TEST_REPLICA_SIZE="2")
    env["OSCARS_TEST_SHARD"] = "1" if shard else "0"
    # Four ranks start beside two other sequences' on two cores: once, a restart's ranks waited more than 30 s for
    # rank 0's rendezvous store. The failure itself is seen from a closed connection, not from this timeout.
    env["OSCARS_TEST_TIMEOUT_S"] = "90"
    env["OSCARS_TEST_PRECISION"] = "bf16-mixed"
    code, log = run([sys.executable, CASE, str(out)], {**env, "OSCARS_TEST_KILL": "6", "OSCARS_TEST_KILL_RANK": "2"})
    lost = {pid for pid in pids_by_last_step(out) if rank_of(out, pid) in (2, 3)}
    return out, [(code, log, lost), (*run([sys.executable, CASE, str(out)], env), set())]


@pytest.mark.extended
@pytest.mark.parametrize("sequence", ["replicas", "sharded"])
def test_with_replica_groups_a_replica_is_the_unit_lost(sequences, sequence):
    """Rank 2's replica partner fails inside a step's gradient all-reduce (sharded: an all-gather or reduce-scatter)
    and saves nothing; replica 0's ranks save at the averaging. The restart (four ranks) resumes replica 0 from its
    state and replica 1 from a copy, merged with no weight."""
    out, ((first, log1, lost), (last, log2, _)) = sequences[sequence]
    assert first != 0 and log1.count("This rank's state is saved in") == 2, log1[-4000:]
    assert last == 0 and restored_step(log2) is not None, log2[:3000] + "\n[...]\n" + log2[-4000:]
    assert_recovered(out, lost, ranks=4)


BATCH_BALANCE = {"OSCARS_TEST_BALANCE": "batch", "OSCARS_TEST_ACCUMULATE": "2"}


def _batch_balance_runs(out: Path) -> tuple[Path, Runs]:
    """``balance="batch"`` with gradient accumulation 2: a fit left alone (in ``out/uninterrupted``); the same fit
    with rank 1 SIGKILLed as step 5 starts (epoch 1: rank 0 dies in the all-reduce of that step's second
    micro-batch); then restarted to the end."""
    env = clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT - 20), **BATCH_BALANCE)
    alone = out / "uninterrupted"
    alone.mkdir()
    runs = [(*run([sys.executable, CASE, str(alone)], env), set())]
    runs.append((*run([sys.executable, CASE, str(out)], {**env, "OSCARS_TEST_KILL": "5"}), set()))
    runs.append((*run([sys.executable, CASE, str(out)], env), set()))
    return out, runs


@pytest.mark.extended
def test_under_batch_balance_a_lost_rank_costs_its_step_and_the_fit_ends_as_if_never_interrupted(sequences):
    """Batch balance takes ddp's steps: the survivor saves its state as of the last step taken, rewound to that
    step's first micro-batch, and the restart trains every sample in exactly one step taken and ends with the
    weights of the fit that lost nobody."""
    out, ((alone, log0, _), (first, log1, _), (last, log2, _)) = sequences["batch"]
    assert alone == 0, log0[-3000:]
    assert first != 0 and "This rank's state is saved in" in log1, log1[-3000:]
    assert last == 0 and restored_step(log2) == 5, log2[-3000:]
    results = assert_steps_applied_once(out, 5, ranks=2)
    reference = json.loads((out / "uninterrupted" / "rank0.json").read_text())
    assert reference["global_step"] == results[0]["global_step"] == 8
    assert max(abs(a - b) for a, b in zip(reference["weights"], results[0]["weights"])) < 1e-5


def _two_survivor_runs(out: Path) -> tuple[Path, Runs]:
    """Three ranks, rank 2 SIGKILLed as step 6 starts (ranks 0 and 1 survive, each with its own progress since the
    last averaging); then three ranks to the end."""
    env = clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT - 20), OSCARS_TEST_DEVICES="3")
    code, log = run([sys.executable, CASE, str(out)], {**env, "OSCARS_TEST_KILL": "6", "OSCARS_TEST_KILL_RANK": "2"})
    lost = {pid for pid in pids_by_last_step(out) if rank_of(out, pid) == 2}
    return out, [(code, log, lost), (*run([sys.executable, CASE, str(out)], env), set())]


@pytest.mark.extended
def test_a_restart_merges_every_survivors_own_model(sequences):
    """The restarted ranks start from their own survivors' states (rank 2, which the failed world lost, from a copy
    of rank 0's), not all from rank 0's: the first collective merges them, and the fit ends on one model."""
    out, ((first, log1, lost), (last, log2, _)) = sequences["two_survivors"]
    assert first != 0 and log1.count("This rank's state is saved in") == 2, log1[-3000:]
    assert last == 0 and restored_step(log2) is not None, log2[-3000:]
    results = assert_recovered(out, lost, ranks=3)
    starting = [r["starting_weights"] for r in results]
    assert starting[0] == starting[2] != starting[1], "each survivor's own state until the merge"


def _rank_batch_size_runs(out: Path) -> tuple[Path, Runs]:
    """Local steps with ``batch_sizes=[8, 4]`` (rank 0 trains 8 samples a step, rank 1 four): rank 1 SIGKILLed as
    step 6 starts; then restarted to the end."""
    env = clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT - 20), OSCARS_TEST_BATCH_SIZES="[8, 4]")
    code, log = run([sys.executable, CASE, str(out)], {**env, "OSCARS_TEST_KILL": "6"})
    lost = {pid for pid in pids_by_last_step(out) if rank_of(out, pid) == 1}
    return out, [(code, log, lost), (*run([sys.executable, CASE, str(out)], env), set())]


@pytest.mark.extended
def test_with_per_rank_batch_sizes_a_lost_rank_costs_its_share_of_the_round(sequences):
    out, ((first, log1, lost), (last, log2, _)) = sequences["rank_sizes"]
    assert first != 0 and "This rank's state is saved in" in log1, log1[-3000:]
    assert last == 0 and restored_step(log2) is not None, log2[-3000:]
    assert_recovered(out, lost, ranks=2)
    sizes = collections.Counter(
        (json.loads(line)["rank"], len(json.loads(line)["indices"]))
        for path in out.glob("trained-*.jsonl")
        for line in path.read_text().splitlines()
    )
    assert {size for (rank, size), _ in sizes.items() if rank == 0} - {8} <= {4}, sizes  # 8, but the epoch's tail
    assert {size for (rank, size), _ in sizes.items() if rank == 1} == {4}, sizes


@pytest.mark.extended
def test_torchrun_restarts_its_ranks_and_they_go_on_from_the_survivors_state(tmp_path):
    """One torchrun agent, two ranks, ``--max-restarts=1``; rank 1 is SIGKILLed mid-epoch. Rank 0 saves its state and
    fails; the agent restarts both ranks, which find the recovery point by themselves (rank 1 from a copy)."""
    cmd = torchrun(free_port(), "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1")
    code, log = run([*cmd, str(tmp_path)], torchrun_env("9"))
    assert code == 0, log[-4000:]
    assert "This rank's state is saved in" in log and restored_step(log) is not None, log[-4000:]
    killed = {pid for pid, last in pids_by_last_step(tmp_path).items() if last < 9}
    assert len(killed) == 1
    assert_recovered(tmp_path, killed, ranks=2)


@pytest.mark.extended
@pytest.mark.parametrize("balance", ["steps", "batch"])
def test_an_elastic_torchrun_job_goes_on_in_a_smaller_world_when_a_node_dies(tmp_path, balance):
    """Two agents on loopback (``--nnodes=1:2``), one rank each; node 1's rank is SIGKILLed and its agent with it. The
    surviving agent restarts its rank in a world of one, which resumes from its own saved state (under batch balance,
    the rest of the epoch in the world of one's global batches)."""
    port = free_port()
    args = ("--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=2", "--rdzv-conf=last_call_timeout=2")
    # Rank 1 dies as global step 9 starts (under batch balance 5: its 4 steps an epoch are of 2 micro-batches each).
    env = {**torchrun_env("9"), **({**BATCH_BALANCE, "OSCARS_TEST_KILL": "5"} if balance == "batch" else {})}
    host = start([*torchrun(port, *args), str(tmp_path)], env)
    wait_until_listening(port, host)  # the first agent hosts the rendezvous store: it must survive
    node = start([*torchrun(port, *args), str(tmp_path)], {**env, "OSCARS_TEST_KILL_AGENT": "1"})
    try:
        code, log = finish(host)
    finally:
        kill_group(node)
    assert code == 0, log[-4000:]
    if balance == "batch":
        assert restored_step(log) == 5, log[-4000:]
        result = assert_steps_applied_once(tmp_path, 5, ranks=1)[0]
    else:
        killed = {pid for pid, last in pids_by_last_step(tmp_path).items() if last < 9}
        result = assert_recovered(tmp_path, killed, ranks=1)[0]
    assert result["world_size"] == 1


@pytest.mark.extended
@pytest.mark.parametrize("strategy", ["oscars", "ssp"])
def test_a_slurm_job_requeued_after_a_node_died_goes_on_from_the_survivors_state(tmp_path, strategy):
    """Two nodes of one task each, started as srun starts them (Lightning's SLURMEnvironment, no launcher): node 1's
    task is SIGKILLed mid-epoch, SLURM sends the survivor SIGTERM (and SIGKILL 30 s later); the survivor saves its
    state and exits. The requeued job (the same script, two tasks again) goes on from it."""
    env = clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT - 20), OSCARS_TEST_KILL="9")
    if strategy != "oscars":
        env["OSCARS_TEST_STRATEGY"] = strategy
    codes, log = srun(tmp_path, env, nodes=2)
    assert codes[1] == -9 and codes[0] != 0 and "This rank's state is saved in" in log, (codes, log[-4000:])
    killed = {pid for pid, last in pids_by_last_step(tmp_path).items() if last < 9}
    codes, log = srun(tmp_path, env, nodes=2)  # the requeue
    assert codes == [0, 0] and restored_step(log) is not None, (codes, log[-4000:])
    assert_recovered(tmp_path, killed, ranks=2)
