"""Every strategy trains any ordinary model on 2 ranks: a buffer-less MLP, one with BatchNorm and one with frozen
parameters, rank 1 3x slower (one launch of ``paradigm_models_case.py``, every fit in the same two processes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from paradigm_models_case import MODELS, SAMPLES, STRATEGIES
from subproc import ROOT, assert_clean_exit, clean_env, run

TIMEOUT_S = 420


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    out = tmp_path_factory.mktemp("paradigm_models")
    env = clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT_S - 20))
    code, log = run([sys.executable, str(ROOT / "tests" / "paradigm_models_case.py"), str(out)], TIMEOUT_S, env)
    assert_clean_exit(code, log, TIMEOUT_S)
    return [json.loads(Path(out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_trains_the_model_to_one_model_on_every_sample_once(
    results: list[dict[str, dict]], strategy: str, model: str
) -> None:
    fast, slow = (r[f"{strategy}/{model}"] for r in results)
    for r in (fast, slow):
        assert "error" not in r, r["error"]
        assert r["frozen_kept"], "a frozen parameter changed"
    assert fast["weights"] == slow["weights"], "the ranks ended with different weights"
    assert fast["global_step"] == slow["global_step"]
    assert fast["trained"].keys() == slow["trained"].keys() == {"0"}
    trained = sorted(fast["trained"]["0"] + slow["trained"]["0"])
    assert trained == list(range(SAMPLES)), "every sample once in the epoch, across the ranks"


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", MODELS)
def test_server_momentum_is_one_buffer_over_the_trainable_parameters_on_every_rank(
    results: list[dict[str, dict]], model: str
) -> None:
    fast, slow = (r[f"ssp+server_momentum/{model}"] for r in results)
    assert fast["server_velocity"] is not None, "the buffer a checkpoint carries"
    assert fast["server_velocity"] == slow["server_velocity"], "every rank checkpoints the same buffer"
    assert len(fast["server_velocity"]) == fast["trainable"], "one value per trainable parameter"
    assert any(v != 0.0 for v in fast["server_velocity"])
    for name in STRATEGIES:  # the others keep no server buffer
        if name != "ssp+server_momentum":
            assert results[0][f"{name}/{model}"]["server_velocity"] is None


@pytest.mark.multiprocess
def test_server_momentum_resumes_from_the_checkpoint_on_every_shard(results: list[dict[str, dict]]) -> None:
    for rank in results:
        assert rank["resume"] == {"velocity_resumed": True, "saved_nonzero": True}
