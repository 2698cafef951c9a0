"""Oscars leaves Lightning as it found it: a second fit on the same Trainer, validate/test after fit and a ddp
Trainer after an oscars one behave exactly as without oscars (2 ranks through Lightning's launcher, gloo)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from subproc import assert_clean_exit, clean_env, run

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
TIMEOUT = 150


def _run(mode: str, out: Path) -> list[dict]:
    out.mkdir(parents=True)
    env = clean_env(PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    code, log = run([sys.executable, str(HERE / "lifecycle_case.py"), mode, str(out)], TIMEOUT, env=env)
    assert_clean_exit(code, log, TIMEOUT)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_second_fit_evaluation_and_a_later_ddp_trainer_are_unaffected(tmp_path):
    ranks = _run("oscars_then_ddp", tmp_path / "oscars")
    for rank in ranks:
        first, second = rank["fits"]
        # After each fit nothing of oscars is left in Lightning's loops, connectors, callbacks or signal handlers.
        assert first["patched"] == second["patched"] == []
        # The round callbacks are gone after each fit; the monitor it added stays (the user's view of the fit), once.
        for fit in (first, second):
            assert "EpochCallback" not in fit["callbacks"] and "RoundCallback" not in fit["callbacks"]
            assert fit["callbacks"].count("ScheduleMonitor") == 1
        # A paradigm's process groups do not pile up over fits: each fit's are destroyed once every rank is past it.
        alive = rank["groups_after_server_fits"]
        assert alive[0] == alive[1] == alive[2], alive
        assert first["handlers_restored"] and second["handlers_restored"] and rank["handlers_restored"]
        # The second fit (one more epoch) ran its own rounds from 1 on, once over the data.
        assert second["rounds"][0] == 1 and len(second["rounds"]) > 1
        assert first["seen"] > 0 and second["seen"] > 0
    assert ranks[0]["fits"][0]["seen"] + ranks[1]["fits"][0]["seen"] == 256
    assert ranks[0]["fits"][1]["seen"] + ranks[1]["fits"][1]["seen"] == 256
    assert ranks[0]["fits"][1]["weights"] == ranks[1]["fits"][1]["weights"]
    # validate / test after fit: one averaged model, one value on every rank, weights untouched.
    assert ranks[0]["validate"] == ranks[1]["validate"] and "val_acc" in ranks[0]["validate"][0]
    assert ranks[0]["test"] == ranks[1]["test"] and "test_acc" in ranks[0]["test"][0]
    assert ranks[0]["eval_weights"] == ranks[0]["fits"][1]["weights"]
    # A ddp Trainer after the oscars one trains exactly as ddp does in a process that never saw oscars.
    alone = _run("ddp_only", tmp_path / "ddp")
    assert ranks[0]["ddp_weights"] == ranks[1]["ddp_weights"] == alone[0]["ddp_weights"]
