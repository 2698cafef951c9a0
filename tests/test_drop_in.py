"""examples/drop_in.py, a script written for ddp, runs unchanged with ``--strategy oscars`` on 2 CPU ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from subproc import ROOT, assert_clean_exit, run

from lightning_oscars.core.partition import max_epoch_slots

TIMEOUT = 120


@pytest.mark.multiprocess
def test_drop_in_script_under_oscars(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "examples" / "drop_in.py"), "--strategy", "oscars", "--max-epochs", "2"]
    code, log = run([*cmd, "--out", str(out)], timeout=TIMEOUT)
    assert_clean_exit(code, log, TIMEOUT)
    result = json.loads((out / "result.json").read_text())
    assert result["strategy"] == "oscars" and result["world_size"] == 2
    assert result["val_acc"] > 0.5, result  # chance is 0.1
    # The OneCycle schedule was sized from estimated_stepping_batches, an upper bound under oscars: never overrun.
    assert 0 < result["global_step"] <= result["scheduled_steps"], result
    # ... and that bound is the proven one for the default bounds (a round's busiest rank takes at most 16 local
    # steps). On 2 ranks it reaches the data set's batch count (8192 samples in batches of 64), and the fit, whose
    # fast rank takes about 3 of every 4 batches, stays well below it.
    batches = 8192 // 64
    assert result["scheduled_steps"] == 2 * max_epoch_slots(batches, 2, 16, last_round=16) == 2 * batches
    assert result["global_step"] < 0.9 * result["scheduled_steps"], result
    # ModelCheckpoint(monitor="val_acc") kept the best averaged model, with oscars' schedule stored alongside.
    best = Path(result["best_model_path"])
    assert best.is_file() and best.parent == out / "checkpoints"
    checkpoint = torch.load(best, map_location="cpu", weights_only=False)
    assert checkpoint["callbacks"] and "oscars" in checkpoint
    local_steps = checkpoint["oscars"]["local_steps"]
    assert len(local_steps) == 2 and local_steps[0] > local_steps[1], local_steps  # rank 1 is 3x slower
    assert (out / "checkpoints" / "last.ckpt").is_file()
