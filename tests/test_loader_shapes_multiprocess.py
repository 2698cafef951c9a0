"""The shapes real Lightning libraries give their loaders and models (issue 56), in both Lightning namespaces, on 2
ranks through Lightning's launcher, rank 1 three times slower and ``warmup_steps=1`` (``tests/loader_shapes_case.py``):

* a length-bucketed ``batch_sampler``, ``batch_size=None`` over a ``BatchSampler``, a library's ``DistributedSampler``
  subclass yielding batches, a loader subclass whose own ``__iter__`` zips two loaders: every rank ends with the
  same parameters and buffers, and every sample is trained once per epoch;
* a forecasting model's masks, non-persistent buffers rebuilt for each batch size: ranks hold masks of different
  shapes, the state dict is the same on both; the same masks made persistent: one error on every rank naming each
  buffer and each rank's shape (not a lost rank);
* under ``pytorch_lightning``: every registered strategy name, and an ``OscarsStrategy`` made from ``lightning_oscars``
  (bound to ``lightning.pytorch``) handed to a ``pytorch_lightning.Trainer``;
* a dict or list of training loaders in ``CombinedLoader``'s modes (``sequential`` refused, as ddp's fit refuses it);
* a library's own iterable of ready batches (not a DataLoader): ddp's budget of batches per epoch, dealt by speed;
* a callback that pickles the module into a spawned process from rank 0 (``ServableModuleValidator``);
* a failure on one rank while the epoch is prepared (a custom sampler's draw on rank 0, the user's
  ``train_dataloader`` or a sampler's ``set_epoch`` on rank 1, a training set of another size on rank 1): every rank
  raises at once, with the failing rank's message."""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest
from lightning.pytorch.strategies import StrategyRegistry
from subproc import ROOT, assert_clean_exit, clean_env, run_in_pairs

import lightning_oscars

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
COMBINED = ("dict_max_size_cycle", "dict_max_size", "dict_min_size", "list_max_size_cycle")
LOADERS = ("buckets", "batch_none", "dist_subclass", "zip")
OURS = sorted(
    name for name, entry in StrategyRegistry.items() if entry["strategy"].__module__.startswith("lightning_oscars.")
)
NAMES = tuple(f"name:{name}" for name in OURS)
SHAPES = {"lightning.pytorch": ["shapes:batch_none"], "pytorch_lightning": ["shapes:dist_subclass"]}
RESUMES = {"lightning.pytorch": ["resume:buckets"], "pytorch_lightning": ["resume:zip"]}
OWN_BATCHES = ("own_windows", "ddp:own_windows")
ONE_RANK_FAILS = ("build_fails", "set_epoch_fails", "size_differs")
TIMEOUT = 240
SAMPLES = 45


def _cases(ns: str) -> list[str]:
    if ns == "pytorch_lightning":
        return [*LOADERS, "masks", *SHAPES[ns], *RESUMES[ns], "object_of_lightning", *NAMES, "draw_fails"]  # fails last
    failing = ["dict_sequential", "ddp:dict_sequential", "batch_balance_buckets", "persistent_masks", *ONE_RANK_FAILS]
    return [*LOADERS, "masks", *SHAPES[ns], *RESUMES[ns], "servable", *COMBINED, *OWN_BATCHES, *failing]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[tuple[str, str], list[dict]]:
    out = tmp_path_factory.mktemp("loader_shapes")
    script = str(ROOT / "tests" / "loader_shapes_case.py")
    cmds = [[sys.executable, script, ns, "+".join(_cases(ns)), str(out / ns)] for ns in NAMESPACES]
    for code, log in run_in_pairs(cmds, TIMEOUT, env=clean_env(OSCARS_TEST_DUMP_AFTER=str(TIMEOUT - 20))):
        assert_clean_exit(code, log, TIMEOUT)
    found = {}
    for ns in NAMESPACES:
        for case in _cases(ns):
            folder = out / ns / case.replace(":", "_")
            found[ns, case] = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
            if case.startswith("resume:"):
                found[ns, f"{case}:first"] = [json.loads((folder / f"first_rank{r}.json").read_text()) for r in (0, 1)]
    return found


def _assert_identical_and_every_sample_once(pair: list[dict]) -> None:
    fast, slow = pair
    assert "error" not in fast and "error" not in slow, (fast.get("traceback"), slow.get("traceback"))
    assert fast["state"] == slow["state"]  # every parameter and buffer of the state dict, bitwise
    assert len(fast["trained"]) == len(slow["trained"]) == 3
    for mine, theirs in zip(fast["trained"], slow["trained"]):
        assert sorted(mine + theirs) == list(range(SAMPLES))  # every sample once in every epoch


@pytest.mark.multiprocess
@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("loader", LOADERS)
def test_a_loader_that_batches_itself_trains_every_sample_once_with_identical_ranks(ranks, namespace, loader):
    pair = ranks[namespace, loader]
    _assert_identical_and_every_sample_once(pair)
    assert pair[0]["steps"] != pair[1]["steps"], "the ranks took unequal local steps"


@pytest.mark.multiprocess
@pytest.mark.parametrize(("namespace", "case"), [(ns, case) for ns in NAMESPACES for case in SHAPES[ns]])
def test_buffer_less_frozen_unowned_and_parametrized_weights_train_at_equal_speeds_and_validate(ranks, namespace, case):
    """No buffers, a frozen layer, a parameter no optimizer owns, a parametrized weight; no rank slowed down, and
    validation twice per epoch (rounds end there): identical state, every sample once, one validation figure."""
    pair = ranks[namespace, case]
    _assert_identical_and_every_sample_once(pair)
    fast, slow = pair
    assert fast["buffers"] == {} and "net.0.parametrizations.weight.original" in fast["state"]
    for untouched in ("frozen.weight", "frozen.bias", "temperature"):  # frozen, and owned by no optimizer
        assert fast["state"][untouched] == fast["initial"][untouched]
    assert fast["state"]["net.2.weight"] != fast["initial"]["net.2.weight"]
    assert fast["val_loss"] is not None and fast["val_loss"] == slow["val_loss"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("namespace", "case"), [(ns, case) for ns in NAMESPACES for case in RESUMES[ns]])
def test_a_resume_mid_epoch_trains_the_rest_once_then_whole_epochs(ranks, namespace, case):
    """Checkpoints every 3 steps; the second fit resumes from step 3 (in the first epoch): what both ranks trained
    before step 3 and what the resumed fit trained in that epoch are the epoch, once; the next epoch is whole; both
    ranks end with the same state and the same checkpoint callback state."""
    first, (fast, slow) = ranks[namespace, f"{case}:first"], ranks[namespace, case]
    assert all("error" not in rank for rank in (*first, fast, slow)), [r.get("traceback") for r in (fast, slow)]
    before = [i for rank in first for step, ids in rank["trained_steps"] if step < 3 for i in ids]
    assert 0 < len(before) < SAMPLES
    assert sorted(before + fast["trained"][0] + slow["trained"][0]) == list(range(SAMPLES))
    assert len(fast["trained"]) == 2 and sorted(fast["trained"][1] + slow["trained"][1]) == list(range(SAMPLES))
    assert fast["state"] == slow["state"] and fast["global_step"] == slow["global_step"]
    assert fast["checkpoint_state"] == slow["checkpoint_state"] != [], "ModelCheckpoint's state, on every rank"


@pytest.mark.multiprocess
@pytest.mark.parametrize("namespace", NAMESPACES)
def test_non_persistent_buffers_rebuilt_per_batch_are_left_to_the_module(ranks, namespace):
    pair = ranks[namespace, "masks"]
    _assert_identical_and_every_sample_once(pair)
    shapes = {tuple(rank["buffers"]["attention_mask"]) for rank in pair}
    assert len(shapes) == 2, "one rank trained the short last batch: its masks are smaller, and stay its own"


@pytest.mark.multiprocess
def test_a_persistent_buffer_of_different_shapes_is_one_error_on_every_rank_naming_it(ranks):
    fast, slow = ranks["lightning.pytorch", "persistent_masks"]
    assert fast["error"] == slow["error"]
    assert fast["error"].startswith("ValueError: The ranks hold tensors of different shapes")
    for buffer, shape in (("attention_mask", "(8, 8)"), ("relative_index", "(8,)")):
        assert f"buffer {buffer!r}: {shape} on rank 0" in fast["error"] or f"{shape} on rank 1" in fast["error"]
    assert "did not reach" not in fast["error"] and "lost" not in fast["error"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["object_of_lightning", *NAMES])
def test_every_strategy_trains_a_pytorch_lightning_trainer_with_identical_ranks(ranks, case):
    pair = ranks["pytorch_lightning", case]
    _assert_identical_and_every_sample_once(pair)
    assert pair[0]["strategy_class"].startswith("lightning_oscars.pytorch_lightning.")


def test_every_registered_name_is_registered_in_pytorch_lightning_too():
    import pytorch_lightning

    assert lightning_oscars  # imported first: the standalone registry fills when pytorch_lightning is imported
    standalone = pytorch_lightning.strategies.StrategyRegistry
    assert len(OURS) == 10 and all(name in standalone for name in OURS)
    for name in OURS:
        theirs = standalone[name]["strategy"]
        assert theirs.__module__.startswith("lightning_oscars.pytorch_lightning.")
        assert issubclass(theirs, pytorch_lightning.strategies.DDPStrategy)
        assert StrategyRegistry[name]["init_params"] == standalone[name]["init_params"]


@pytest.mark.multiprocess
def test_a_callback_that_serves_the_module_from_rank_zero_sees_it_as_the_user_wrote_it(ranks):
    """As ``ServableModuleValidator``: rank 0 alone pickles the module into a spawned process at training start and
    end (the fit's patched ``all_gather`` travels as the module's own method), while rank 1 trains on."""
    pair = ranks["lightning.pytorch", "servable"]
    _assert_identical_and_every_sample_once(pair)
    served = pair[0]["served"]
    assert len(served) == 2 and pair[1]["served"] == []
    for there, here in served:
        assert there == here  # the process ran the same model


@pytest.mark.multiprocess
def test_a_failed_draw_on_rank_zero_is_every_ranks_error_at_once(ranks):
    fast, slow = ranks["pytorch_lightning", "draw_fails"]
    assert fast["error"] == "ValueError: this sampler cannot draw epoch 1"
    assert slow["error"].startswith("EpochDrawError: Rank 0 failed to draw the order of training epoch 1")
    assert fast["error"].split(": ", 1)[1] in slow["error"]
    assert abs(fast["failed_at"] - slow["failed_at"]) < 5.0  # not when rank 0's process exits


def _per_loader(pair: list[dict], epoch: int) -> tuple[Counter, Counter]:
    """How often each sample of loader ``a`` (ids below 1000) and ``b`` was trained in ``epoch``, by both ranks."""
    ids = pair[0]["trained"][epoch] + pair[1]["trained"][epoch]
    return Counter(i for i in ids if i < 1000), Counter(i for i in ids if i >= 1000)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", COMBINED)
def test_several_training_loaders_train_as_their_combined_mode_says_with_identical_ranks(ranks, case):
    """``a``: 45 samples in 6 batches of 8; ``b``: 20 samples in 4 batches of 5 (``tests/loader_shapes_case.py``)."""
    pair = ranks["lightning.pytorch", case]
    fast, slow = pair
    assert "error" not in fast and "error" not in slow, (fast.get("traceback"), slow.get("traceback"))
    assert fast["state"] == slow["state"] and fast["steps"] > slow["steps"]
    for epoch in range(3):
        a, b = _per_loader(pair, epoch)
        if case.endswith("min_size"):  # the shortest leads: b's 4 batches, a's first 4 (32 samples), each once
            assert sorted(b) == list(range(1000, 1020)) and max(b.values()) == 1
            assert len(a) == 32 and max(a.values()) == 1
            continue
        assert sorted(a) == list(range(45)) and max(a.values()) == 1  # the longest leads: every sample once
        assert sorted(b) == list(range(1000, 1020))
        # "max_size_cycle": b cycles (its first 2 batches again: 30 samples); "max_size": b once, then nothing.
        assert sum(b.values()) == (30 if case.endswith("max_size_cycle") else 20)


@pytest.mark.multiprocess
def test_sequential_training_loaders_are_refused_on_every_rank_as_ddp_refuses_them(ranks):
    fast, slow = ranks["lightning.pytorch", "dict_sequential"]
    assert fast["error"] == slow["error"] and "mode 'sequential'" in fast["error"]
    assert "does not train under any strategy" in fast["error"] and fast["trained"] == []
    under_ddp = ranks["lightning.pytorch", "ddp:dict_sequential"]
    assert all('does not support the `CombinedLoader(mode="sequential")`' in rank["error"] for rank in under_ddp)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("case", "cause", "while_"),
    [
        ("build_fails", "FileNotFoundError: /data/train-part-1.npy", "requesting its training loaders"),
        ("set_epoch_fails", "FileNotFoundError: shard-000001.tar of epoch 1", "starting training epoch 1"),
    ],
)
def test_a_failure_on_one_rank_preparing_the_epoch_is_every_ranks_error_at_once(ranks, case, cause, while_):
    """Rank 1 alone fails (the user's ``train_dataloader``; a sampler's ``set_epoch`` at the second epoch): rank 0
    raises too, within a second, naming rank 1, what it was doing and its message, instead of waiting in the next
    collective until rank 1's process exits (here it never would: the script goes on to its next case)."""
    fast, slow = ranks["lightning.pytorch", case]
    assert slow["error"].startswith(cause)
    assert fast["error"].startswith(f"PeerFailure: Rank 1 failed while {while_}")
    assert slow["error"] in fast["error"]
    assert abs(fast["failed_at"] - slow["failed_at"]) < 5.0
    assert len(fast["trained"]) == len(slow["trained"]) == (1 if case == "set_epoch_fails" else 0)


@pytest.mark.multiprocess
def test_ranks_with_training_sets_of_different_sizes_are_one_error_naming_each_size(ranks):
    fast, slow = ranks["lightning.pytorch", "size_differs"]
    assert fast["error"] == slow["error"]
    assert "45 samples in 6 batches on rank 0, 40 samples in 5 batches on rank 1" in fast["error"]


@pytest.mark.multiprocess
def test_an_iterable_of_its_own_batches_trains_ddps_budget_dealt_by_speed_with_identical_ranks(ranks):
    """A forecasting library's random windows, 10 batches per pass, each rank drawing from its own copy: under ddp
    each rank trains one pass per epoch (20 batches in all); under oscars the same 20 per epoch, the fast rank more
    than a pass (it starts a second pass of its copy) and the slow one less, both ending with the same state."""
    fast, slow = ranks["lightning.pytorch", "own_windows"]
    assert "error" not in fast and "error" not in slow, (fast.get("traceback"), slow.get("traceback"))
    assert fast["state"] == slow["state"] and len(fast["trained"]) == len(slow["trained"]) == 3
    per_pass = 10
    for mine, theirs in zip(fast["trained"], slow["trained"]):
        assert (len(mine) + len(theirs)) // 8 == 2 * per_pass  # batches of 8
    assert fast["steps"] > 3 * per_pass > slow["steps"]
    assert fast["passes"] > 3 >= slow["passes"]  # the fast rank drew into further passes of its own copy
    under_ddp = ranks["lightning.pytorch", "ddp:own_windows"]
    assert [len(rank["trained"][0]) // 8 for rank in under_ddp] == [per_pass, per_pass]


@pytest.mark.multiprocess
def test_balance_batch_refuses_a_loader_that_batches_itself_naming_the_option(ranks):
    fast, slow = ranks["lightning.pytorch", "batch_balance_buckets"]
    assert fast["error"] == slow["error"]
    assert "balance='batch' cannot apply" in fast["error"] and "custom batch_sampler" in fast["error"]
