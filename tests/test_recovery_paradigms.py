"""Surviving a lost rank under the paradigms: the parameter server's (BSP, ASP, SSP, DASP) and ripples'.

Their ranks exchange after every step, so the survivors learn of the loss at different slots; each trains no further
in the round and saves at the next meeting, where all stand at one slot. The sequences below run
``recovery_case.py`` in restart loops through Lightning's launcher (the script unchanged, no ``ckpt_path``) and
assert the promises of ``recovery_checks.assert_recovered``. The paradigms run with a 10-minute timeout: a survivor
waiting for the dead rank (held back by a staleness bound, or in a group) must see the loss by itself, within the
run's hard timeout. Long runs: the extended run (CI runs it after the default one).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from recovery_checks import (
    CASE,
    TIMEOUT,
    Runs,
    assert_recovered,
    finish,
    pids_by_last_step,
    rank_of,
    restored_step,
    run,
    torchrun,
    torchrun_env,
)
from subproc import clean_env, free_port, kill_group, start, wait_until_listening

pytestmark = [pytest.mark.multiprocess, pytest.mark.extended]

SAVED = "This rank's state is saved in"


def _sequence(out: Path, common: dict[str, str], events: list[dict[str, str]]) -> tuple[Path, Runs]:
    """Run the case once per event (and once more to the end), each a restart of the one before; a run's lost
    processes are those of the rank it killed (``OSCARS_TEST_KILL_RANK``, default 1)."""
    runs: Runs = []
    for event in [*events, {}]:
        seen = {int(p.stem.split("-")[1]) for p in out.glob("trained-*.jsonl")}
        env = clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT - 20), **common, **event)
        env["PYTHONWARNINGS"] = "ignore,default:oscars"  # the strategy's own warnings are shown
        code, log = run([sys.executable, CASE, str(out)], env)
        new = {int(p.stem.split("-")[1]) for p in out.glob("trained-*.jsonl")} - seen
        killed = int(event.get("OSCARS_TEST_KILL_RANK", "1"))
        runs.append((code, log, {pid for pid in new if rank_of(out, pid) == killed} if event else set()))
    return out, runs


SEQUENCES: dict[str, tuple[dict[str, str], list[dict[str, str]]]] = {
    # SSP, rank 1 3x slower: rank 0 waits at the staleness bound for rank 1, which dies there (mid-round); then rank 0
    # dies at the restarted fit's second step (the rank that hosts the rendezvous store: rank 1 must save without it).
    # Relative, and early: where the first failure saved depends on the measured speeds, and once only 4 steps were
    # left after it.
    "ssp": (
        {"OSCARS_TEST_STRATEGY": "ssp"},
        [{"OSCARS_TEST_KILL": "8"}, {"OSCARS_TEST_KILL": "+1", "OSCARS_TEST_KILL_RANK": "0"}],
    ),
    # BSP (every rank waits for every other at every step) on 3 ranks, a BatchNorm model: rank 1 killed in the warm-up
    # round; then killed half-way through a push, once its update reached every server (which then hold a grant for
    # a dead worker: the survivors' servers must go on serving each other).
    "bsp": (
        {"OSCARS_TEST_STRATEGY": "bsp", "OSCARS_TEST_MODEL": "batchnorm", "OSCARS_TEST_DEVICES": "3"},
        [{"OSCARS_TEST_KILL": "2"}, {"OSCARS_TEST_KILL_IN": "push"}],
    ),
    # DASP, equal speeds, a frozen layer, validation twice an epoch and a ModelCheckpoint every 5 steps: rank 1 killed
    # inside a validation, at the first batch of the restarted fit (twice in a row), inside a checkpoint write.
    "dasp": (
        {
            "OSCARS_TEST_STRATEGY": "dasp",
            "OSCARS_TEST_MODEL": "frozen",
            "OSCARS_TEST_SLOWDOWN": "1",
            "OSCARS_TEST_VALIDATE": "1",
            "OSCARS_TEST_CHECKPOINT_EVERY": "5",
        },
        [
            {"OSCARS_TEST_KILL_IN": "validation"},
            {"OSCARS_TEST_KILL_IN": "first"},
            {"OSCARS_TEST_KILL_IN": "checkpoint"},
        ],
    ),
    # ASP on 3 ranks: rank 2 killed mid-epoch; the restart has 3 ranks again (one starts from a copy).
    "asp": (
        {"OSCARS_TEST_STRATEGY": "asp", "OSCARS_TEST_DEVICES": "3"},
        [{"OSCARS_TEST_KILL": "9", "OSCARS_TEST_KILL_RANK": "2"}],
    ),
    # Ripples (groups of up to 3, exchanged a step late) on 3 ranks: rank 1 killed mid-round.
    "ripples": ({"OSCARS_TEST_STRATEGY": "ripples", "OSCARS_TEST_DEVICES": "3"}, [{"OSCARS_TEST_KILL": "8"}]),
}


@pytest.fixture(scope="module")
def paradigm_sequences(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Runs]]:
    """Every sequence of :data:`SEQUENCES`, side by side (each one's runs one after the other)."""
    made: dict[str, Callable[[], tuple[Path, Runs]]] = {
        name: (lambda name=name, spec=spec: _sequence(tmp_path_factory.mktemp(name), *spec))
        for name, spec in SEQUENCES.items()
    }
    with ThreadPoolExecutor(max_workers=len(made)) as pool:
        futures = {name: pool.submit(make) for name, make in made.items()}
        return {name: future.result() for name, future in futures.items()}


def _assert_each_failure_saved_and_the_next_run_resumed(runs: Runs) -> None:
    *failed, (last, last_log, _) = runs
    for code, log, _ in failed:
        assert code != 0 and SAVED in log, log[-4000:]
    assert last == 0, last_log[-4000:]
    points = [restored_step(log) for _, log, _ in runs[1:]]
    assert None not in points and points == sorted(points), points


@pytest.mark.parametrize("paradigm", list(SEQUENCES))
def test_a_paradigm_goes_on_from_the_survivors_states_after_each_lost_rank(paradigm_sequences, paradigm):
    out, runs = paradigm_sequences[paradigm]
    _assert_each_failure_saved_and_the_next_run_resumed(runs)
    ranks = int(SEQUENCES[paradigm][0].get("OSCARS_TEST_DEVICES", "2"))
    results = assert_recovered(out, set().union(*(lost for _, _, lost in runs)), ranks=ranks)
    if paradigm == "dasp":  # callback state is one state after three recoveries
        states = [r["checkpoint_callback"] for r in results]
        assert states[0]["best_k_models"] and all(state == states[0] for state in states), states


def test_a_parameter_server_job_under_torchrun_goes_on_in_a_smaller_world_when_a_node_dies(tmp_path):
    """Two elastic agents (``--nnodes=1:2``), one rank each, SSP; node 1's rank is SIGKILLed with its agent. The
    surviving agent restarts its rank in a world of one: the server runs on one shard, from the survivor's state."""
    port = free_port()
    args = ("--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=2", "--rdzv-conf=last_call_timeout=2")
    env = {**torchrun_env("9"), "OSCARS_TEST_STRATEGY": "ssp"}
    host = start([*torchrun(port, *args), str(tmp_path)], env)
    wait_until_listening(port, host)  # the first agent hosts the rendezvous store: it must survive
    node = start([*torchrun(port, *args), str(tmp_path)], {**env, "OSCARS_TEST_KILL_AGENT": "1"})
    try:
        code, log = finish(host)
    finally:
        kill_group(node)
    assert code == 0 and SAVED in log, log[-4000:]
    killed = {pid for pid, last in pids_by_last_step(tmp_path).items() if last < 9}
    result = assert_recovered(tmp_path, killed, ranks=1)[0]
    assert result["world_size"] == 1
