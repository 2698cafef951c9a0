"""The benchmark's training job (behind the README's demo command) runs and writes what the reports read."""

from __future__ import annotations

import json
import sys

import pytest
from subproc import ROOT, assert_clean_exit, clean_env, run

pytestmark = pytest.mark.multiprocess

TIMEOUT = 150


@pytest.mark.extended  # the benchmark harness end to end: a long run, in the extended run CI runs
def test_train_job_writes_a_json_summary_with_the_round_history(tmp_path):
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "benchmarks.train_job", "--strategy", "oscars", "--epochs", "1", "--out", str(out)]
    code, log = run(cmd, TIMEOUT, env=clean_env(PYTHONPATH=str(ROOT)))
    assert_clean_exit(code, log, TIMEOUT)
    result = json.loads(out.read_text())
    history = result["history"]
    assert result["rounds"] == len(history) > 1
    # Records as the reports and the simulator's validation read them: plain lists, derived fields included.
    first, last = history[0], history[-1]
    assert first["round"] == 1 and first["local_steps"] == [4, 4]
    assert last["local_steps"][0] > last["local_steps"][1], "the 1x rank takes more steps than the 3x one"
    assert {"period", "idle_times", "utilization", "compute_times", "step_times"} <= set(last)
    assert result["step_time_s"] == last["step_times"]


def test_the_recovery_benchmark_counts_against_the_real_training_set():
    # "Samples trained again" is all samples trained minus epochs x this: a wrong size would read as lost work.
    from benchmarks.recovery import TRAIN_SAMPLES
    from benchmarks.task import load_digits_split

    assert TRAIN_SAMPLES == len(load_digits_split()[0])
