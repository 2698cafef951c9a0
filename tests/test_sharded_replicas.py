"""Sharded replicas (``shard_replicas=True``): the options refused and why, the optimizer state's portable keys, and
(one launch of ``sharded_case.py``, 4 ranks as 2 replicas of 2, the second 3x slower) FSDP2 inside each replica
against DDP replicas, what each rank holds, the model shapes users have, every sample once, identical ranks, and
checkpoints resumed across layouts."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from sharded_case import FITS, PEEKING, ROUND_TRIPS
from subproc import ROOT, assert_clean_exit, clean_env, run
from torch import nn

from lightning_oscars import OscarsStrategy
from lightning_oscars.dist.sharding import (
    fsdp_keywords,
    keyed_by_name,
    keyed_by_position,
    parameter_names,
    shard_by_default,
)

TIMEOUT_S = 240
SAMPLES = 65  # replicas_case.SAMPLES


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "set replica_size to 2 or more ranks, or 'node'"),
        ({"replica_size": 2, "overlap_averaging": True}, "cannot be combined with overlap_averaging=True"),
        ({"replica_size": 2, "outer_lr": 0.7}, "cannot be combined with outer_lr=0.7"),
        ({"replica_size": 2, "average_optimizer_state": True}, "average_optimizer_state=True: the optimizer state"),
        ({"replica_size": 2, "balance": "batch"}, "configures local steps"),
        ({"replica_size": "node", "shard_replicas": "yes"}, "shard_replicas must be True or False"),
        ({"replica_size": 2, "shard_replicas": False, "shard_options": {"mesh": 1}}, "set shard_replicas=True"),
        ({"replica_size": 2, "shard_replicas": True, "shard_options": {"mesh": 1}}, "shard_options takes"),
        ({"replica_size": 2, "shard_replicas": True, "save_distributed_checkpoint": 1}, "must be True or False"),
    ],
)
def test_options_sharded_replicas_cannot_take_are_errors_naming_them(options, message):
    with pytest.raises(ValueError, match=message):
        OscarsStrategy(**{"shard_replicas": True, **options})


def test_a_torch_without_fsdp2_is_an_error_naming_the_release_it_needs(monkeypatch):
    import torch.distributed.fsdp

    OscarsStrategy(replica_size=2, shard_replicas=True)  # this torch has it
    monkeypatch.delattr(torch.distributed.fsdp, "fully_shard")  # as on torch 2.5 and older
    with pytest.raises(ImportError, match=r"shard_replicas=True needs torch 2\.6 or newer .* this is torch 2\."):
        OscarsStrategy(replica_size=2, shard_replicas=True)
    OscarsStrategy(replica_size=2)  # DDP replicas do not need it


def test_a_paradigm_refuses_sharded_replicas():
    from lightning_oscars.lightning.paradigms import PARADIGMS

    with pytest.raises(ValueError, match="does not take shard_replicas=True"):
        PARADIGMS["ssp"][0](shard_replicas=True)


def test_parameters_of_the_lightning_module_itself_are_named_as_unshardable():
    class Owner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))
            self.net = nn.Linear(3, 3)

    with pytest.raises(ValueError, match=r"the parameters \['scale'\] belong to the LightningModule itself"):
        shard_by_default(Owner(), mesh=None)  # type: ignore[arg-type]


def test_shard_options_become_fsdp2_keywords_and_bad_ones_are_named():
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    keywords = fsdp_keywords({"mp_policy": {"param_dtype": "bfloat16"}, "offload_policy": "cpu"})
    assert keywords["mp_policy"] == MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert isinstance(keywords["offload_policy"], CPUOffloadPolicy)
    assert fsdp_keywords({"reshard_after_forward": 2}) == {"reshard_after_forward": 2}  # FSDP2's own value, as given
    for bad, named in [
        ({"mp_policy": {"param_dtype": "bf"}}, "['mp_policy']['param_dtype'] must be a dtype or its name, got 'bf'"),
        ({"mp_policy": {"dtype": "float16"}}, "shard_options['mp_policy']"),
        ({"reshard_after_forward": 0}, "must be True, False or a group size, got 0"),
        ({"offload_policy": "disk"}, "must be 'cpu' or an OffloadPolicy"),
    ]:
        with pytest.raises(ValueError, match=re.escape(named)):
            fsdp_keywords(bad)


def test_a_full_optimizer_state_keyed_by_name_and_by_position_round_trips():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.Adam([{"params": model[2].parameters()}, {"params": model[0].parameters(), "lr": 0.1}])
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    names = parameter_names(model, optimizer)
    assert names == ["2.weight", "2.bias", "0.weight", "0.bias"]
    plain = optimizer.state_dict()  # what an unsharded optimizer writes: keyed by position
    by_name = keyed_by_name(plain, names)
    assert by_name["param_groups"][1]["params"] == ["0.weight", "0.bias"] and set(by_name["state"]) == set(names)
    back = keyed_by_position(by_name, names)
    assert back["param_groups"] == plain["param_groups"]
    assert all(torch.equal(back["state"][i]["exp_avg"], plain["state"][i]["exp_avg"]) for i in range(4))


# ------------------------------------------------------------------ 4 ranks, 2 replicas of 2


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    out = tmp_path_factory.mktemp("sharded")
    env = clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT_S - 20))
    code, log = run([sys.executable, str(ROOT / "tests" / "sharded_case.py"), str(out)], TIMEOUT_S, env)
    assert_clean_exit(code, log, TIMEOUT_S)
    return [json.loads(Path(out / f"rank{rank}.json").read_text()) for rank in range(4)]


SHARDED_FITS = [name for name in FITS if name.startswith("sharded")]
RESUMES = ["resume_sharded", "resume_sharded_into_ddp", "resume_ddp_into_sharded"]


@pytest.mark.multiprocess
def test_sharded_replicas_train_to_the_weights_of_ddp_replicas_on_a_pinned_schedule(results):
    ddp, sharded = results[0]["ddp_pinned"], results[0]["sharded_pinned"]
    assert sharded["local_steps"] == ddp["local_steps"] and sharded["global_step"] == ddp["global_step"] > 0
    difference = max(abs(a - b) for a, b in zip(ddp["vector"], sharded["vector"]))
    assert difference < 1e-5, "FSDP2's reduce-scatter inside a replica, shards averaged across: DDP replicas' model"
    assert [r["sharded_pinned"]["validated"] for r in results] == [8, 8, 8, 8], "validation on the full model"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", SHARDED_FITS)
def test_each_rank_holds_its_shard_of_every_parameter_while_training(results, name):
    ranks = [r[name] for r in results]
    assert all(r["sharded"] for r in ranks), "every parameter a DTensor"
    if name not in PEEKING:  # a forward in a callback between steps gathers the root until the step's backward
        # a validation leaves FSDP2's root gathered (it expects a backward): sharded again before training goes on
        assert [r["gathered_steps"] for r in ranks] == [0, 0, 0, 0], "a step began with the whole model held"
    assert ranks[0]["mesh"] == ["replicate", "data_parallel", "tensor_parallel"]
    whole = ranks[0]["whole"]
    for first, second in ((0, 1), (2, 3)):  # a replica's two ranks split the parameters between them
        held = [ranks[first]["held"], ranks[second]["held"]]
        assert sum(held) == whole and max(held) <= whole * 0.6, held


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [*SHARDED_FITS, *RESUMES])
def test_sharded_replicas_end_on_one_model_with_every_sample_once(results, name):
    ranks = [r[name] for r in results]
    assert len({r["weights"] for r in ranks}) == 1, "identical parameters and buffers on every rank after fit"
    assert len({r["global_step"] for r in ranks}) == 1
    for epoch in ranks[0]["trained"]:
        trained = sorted(i for r in ranks for i in r["trained"].get(epoch, []))
        assert trained == list(range(SAMPLES)), f"epoch {epoch}: every sample once across the ranks"
    assert all(r["frozen_kept"] for r in ranks if "frozen_kept" in r), "a frozen layer stays as initialised"


@pytest.mark.multiprocess
def test_forwards_without_a_backward_leave_the_rounds_on_shards(results):
    """A validation every half epoch, and a callback's no-grad forward after every step on the second replica only,
    leave FSDP2's root module gathered (it keeps the root's parameters for the backward it expects): the averagings
    still meet every rank's shard (the second replica averaging whole parameters where the first averages shards was
    a collective mismatch that crashed the fit), and it trains and validates as any other (one model, every sample
    once: the generic tests)."""
    ranks = [r["sharded_peeking"] for r in results]
    assert len({r["validated"] for r in ranks}) == 1, "every rank validated alike"
    assert ranks[0]["validated"] > results[0]["sharded_pinned"]["validated"], "validations inside the epochs too"
    assert len(ranks[0]["local_steps"]) > 2, "several rounds, validations between them"


@pytest.mark.multiprocess
def test_fits_in_one_process_share_one_mesh(results):
    """Every Trainer's fit reuses the mesh's process groups (a new mesh per fit would make groups never freed)."""
    assert len({results[0][name]["shard_group"] for name in SHARDED_FITS}) == 1


@pytest.mark.multiprocess
def test_the_module_can_shard_itself_in_configure_model(results):
    ranks = [r["sharded_configure_model"] for r in results]
    assert ranks[0]["wrapped"].startswith("FSDP") and all(r["sharded"] for r in ranks)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("name", "sharded", "wrapped"),
    [
        ("resume_sharded", True, "FSDPSequential"),
        ("resume_sharded_into_ddp", False, "Sequential"),
        ("resume_ddp_into_sharded", True, "FSDPSequential"),
    ],
)
def test_a_checkpoint_resumes_across_layouts(results, name, sharded, wrapped):
    """One epoch saved under one layout, the second resumed under another: it goes on from the saved step (the
    full model and optimizer state load into shards, and shards' into a whole model)."""
    ranks = [r[name] for r in results]
    assert all(r["sharded"] == sharded for r in ranks) and ranks[0]["wrapped"] == wrapped
    assert list(ranks[0]["trained"]) == ["1"], "only the second epoch trained after the resume"
    assert ranks[0]["global_step"] > 4


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(ROUND_TRIPS))
def test_a_checkpoint_loads_replica_0s_model_and_optimizer_into_every_layout(results, name):
    """Saved at an epoch's end (a distributed checkpoint by default, a full-state file on request), loaded by a
    differently initialised module under another layout (sharded, the module sharding itself, DDP replicas, plain
    oscars, Lightning's ModelParallelStrategy sharding 4 ways), and one ModelParallelStrategy wrote loaded into
    sharded replicas: every rank holds the saved parameters, buffers and momentum exactly (the momentum is replica
    0's: each replica's optimizer state is its own)."""
    ranks = [r[f"round_trip_{name}"] for r in results]
    saved = ranks[0]["saved"]
    if not name.startswith("model_parallel"):  # ModelParallelStrategy holds one optimizer state, sharded 4 ways
        assert ranks[2]["saved"]["momentum"] != saved["momentum"], "the replicas' optimizer states differ"
    for rank in ranks:
        assert rank["saved"]["model"] == saved["model"], "one model on every rank when saved"
        assert rank["loaded"]["model"] == saved["model"] and rank["loaded"]["momentum"] == saved["momentum"]
    assert all(r["sharded"] for r in ranks) == ("ddp" not in name and "plain" not in name)


@pytest.mark.multiprocess
def test_a_distributed_checkpoint_is_the_shards_of_replica_0(results):
    """A directory in Lightning's layout: torch's distributed checkpoint and meta.pt; each rank of replica 0 wrote its
    own shards, the other replica nothing (it holds the same model)."""
    files = results[0]["round_trip_distributed_into_sharded"]["files"]
    assert {".metadata", "meta.pt"} <= set(files)
    assert files["__0_0.distcp"] > 0 and files["__1_0.distcp"] > 0
    assert files.get("__2_0.distcp", 0) == 0 and files.get("__3_0.distcp", 0) == 0
    assert results[0]["round_trip_full_into_sharded"]["files"] is None, "save_distributed_checkpoint=False: a file"


@pytest.mark.multiprocess
@pytest.mark.parametrize("distributed", ["True", "False"])
def test_a_checkpoint_saved_mid_round_holds_one_averaged_model(results, distributed):
    """Every 3 steps, local steps [4, 2]: most saves fall inside a round, where the replicas' models differ; a
    checkpoint averages first, so at every save all four ranks hold one model."""
    saves = [r["checkpoints_mid_round"][distributed] for r in results]
    assert len({len(s) for s in saves}) == 1 and sum(s["mid_epoch"] for s in saves[0]) >= 2
    for at_save in zip(*saves):
        assert len({s["step"] for s in at_save}) == 1
        assert len({s["model"] for s in at_save}) == 1, f"step {at_save[0]['step']}: the ranks' models differ"


@pytest.mark.multiprocess
def test_shard_options_give_fsdp2s_mixed_precision_to_the_default_sharding(results):
    ranks = [r["sharded_fsdp_mixed_precision"] for r in results]
    assert all(r["computed_in"] == "torch.bfloat16" for r in ranks), "forward in bf16 (mp_policy's param_dtype)"
    assert all(r["stored_in"] == ["torch.float32"] for r in ranks), "the shards kept in fp32"
    assert results[0]["sharded_pinned"]["computed_in"] == "torch.float32"


@pytest.mark.multiprocess
def test_each_sharded_replica_trains_its_own_batch_size(results):
    ranks = [r["sharded_replica_sizes"] for r in results]
    for rank, size in zip(ranks, [12, 12, 4, 4]):
        *steps, last = rank["lengths"]
        assert steps and set(steps) == {size} and 1 <= last <= size + 1, rank["lengths"]
    assert sum(sum(rank["lengths"]) for rank in ranks) == SAMPLES


@pytest.mark.multiprocess
def test_a_stop_asked_by_one_rank_stops_every_sharded_replica_at_one_round_boundary(results):
    ranks = [r["sharded_stop"] for r in results]
    assert len({r["global_step"] for r in ranks}) == 1 and len({r["weights"] for r in ranks}) == 1
    assert ranks[0]["trained"].keys() == {"0"}, "stopped in the first of two epochs"
    trained = [i for r in ranks for i in r["trained"]["0"]]
    assert len(trained) == len(set(trained)), "no sample twice"  # (the first round, the warm-up, is the whole epoch)
