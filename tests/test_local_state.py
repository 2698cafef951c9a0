"""Unit tests of the local state taken through the rounds (``local_state.py``) and of user collectives inside a local
step (``local_collectives.py``), in one process."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrizations, prune

from lightning_oscars.core._nn_state import refresh_derived
from lightning_oscars.dist.local_collectives import LocalWorld, local_all_reduce, refused_collectives
from lightning_oscars.dist.local_state import MovingFrozen, callback_state_tensors, write_back


def _student_and_teacher() -> nn.Module:
    model = nn.Module()
    model.student = nn.Linear(3, 2)
    model.teacher = copy.deepcopy(model.student).requires_grad_(False)
    model.backbone = nn.Linear(2, 2).requires_grad_(False)
    return model


def test_a_frozen_parameter_that_moves_is_flagged_and_averaged_from_then_on():
    model = _student_and_teacher()
    frozen = MovingFrozen(model)
    assert frozen.moving == [] and len(frozen.watched) == 4 and frozen.moved_flags() == [0.0] * 4
    with torch.no_grad():
        model.teacher.weight.data.mul_(0.9)  # the .data idiom: no version bump, still seen
    assert frozen.moved_flags() == [1.0, 0.0, 0.0, 0.0]
    # Another rank moved the teacher's bias: the summed flags decide, the same on every rank.
    moved = frozen.adopt([1.0, 1.0, 0.0, 0.0])
    assert moved == [model.teacher.weight, model.teacher.bias]
    assert frozen.moving == moved and frozen.watched == [model.backbone.weight, model.backbone.bias]
    frozen.remember()
    assert frozen.moved_flags() == [0.0, 0.0]
    with pytest.raises(ValueError, match="3 flags for 2"):
        frozen.adopt([0.0, 0.0, 0.0])


def test_a_parameter_frozen_after_the_last_meeting_counts_as_unchanged():
    model = _student_and_teacher()
    frozen = MovingFrozen(model)
    model.student.requires_grad_(False)  # a callback froze it: no fingerprint yet
    with torch.no_grad():
        model.student.weight.add_(1.0)
    assert frozen.moved_flags() == [0.0] * 6


class _LiveEMA:
    def __init__(self) -> None:
        self.ema = {"w": torch.ones(3), "step": torch.tensor(4), "score": torch.tensor(0.5)}

    def state_dict(self):
        return {"ema": self.ema}


class _CopyingEMA:
    def __init__(self) -> None:
        self.value = torch.ones(2)
        self.loaded = 0

    def state_dict(self):
        return {"value": self.value.clone()}

    def load_state_dict(self, state):
        self.value = state["value"]
        self.loaded += 1


def test_callback_state_lists_floating_tensors_and_writes_copies_back():
    live, copying, empty = _LiveEMA(), _CopyingEMA(), _CopyingEMA()
    empty.value = torch.zeros(0, dtype=torch.int64)
    held = callback_state_tensors([live, copying, empty])
    assert [cb for cb, _, _ in held] == [live, copying]
    # sorted keys, the int counter left out
    assert held[0][2][0] is live.ema["score"] and held[0][2][1] is live.ema["w"]
    for _, _, tensors in held:
        for t in tensors:
            t.mul_(3)  # what the all-reduce does in place
    write_back(held)
    assert live.ema["w"].tolist() == [3.0, 3.0, 3.0]
    assert copying.loaded == 1 and copying.value.tolist() == [3.0, 3.0]


def test_refresh_recomputes_the_pruned_weight_and_normalises_spectral_vectors():
    layer = nn.Linear(4, 4)
    prune.l1_unstructured(layer, "weight", amount=0.5)
    with torch.no_grad():
        layer.weight_orig.mul_(2)  # the averaging changed the parameter; the cached masked weight is stale
    refresh_derived(layer)
    assert torch.equal(layer.weight, layer.weight_orig * layer.weight_mask)
    sn = parametrizations.spectral_norm(nn.Linear(5, 3))
    vectors = sn.parametrizations.weight[0]
    with torch.no_grad():
        vectors._u.mul_(0.9)
        vectors._v.mul_(0.5)  # the mean of two different unit vectors is shorter than 1
    refresh_derived(sn)
    assert abs(float(vectors._u.norm()) - 1) < 1e-6 and abs(float(vectors._v.norm()) - 1) < 1e-6


@pytest.mark.parametrize(
    ("op", "expected"),
    [(dist.ReduceOp.SUM, 12.0), (dist.ReduceOp.AVG, 3.0), (dist.ReduceOp.MAX, 3.0), (dist.ReduceOp.PRODUCT, 81.0)],
)
def test_an_all_reduce_inside_a_local_step_acts_as_if_every_rank_held_this_value(monkeypatch, op, expected):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    value = torch.tensor([3.0])
    assert local_all_reduce(value, op) is None and value.item() == expected
    assert local_all_reduce(torch.tensor([1.0]), async_op=True).wait()


def test_local_world_refuses_other_collectives_on_its_thread_only_and_puts_everything_back():
    originals = {name: getattr(dist, name) for name in ("all_reduce", *refused_collectives())}
    outcomes: list[str] = []

    def other_thread() -> None:
        # A parameter server's thread: torch's own function, which fails for want of a process group or, where an
        # earlier test in this process left one behind, gathers; never the refusal.
        try:
            dist.all_gather([torch.zeros(1)], torch.zeros(1))
            outcomes.append("gathered")
        except Exception as error:  # noqa: BLE001 - recorded for the assertion
            outcomes.append(str(error))

    with pytest.raises(RuntimeError, match=r"torch.distributed.all_gather was called inside training_step"):
        with LocalWorld("oscars"):
            assert dist.all_reduce.__wrapped__ is local_all_reduce
            worker = threading.Thread(target=other_thread)
            worker.start()
            worker.join()
            dist.all_gather([torch.zeros(1)], torch.zeros(1))
    assert len(outcomes) == 1 and "inside training_step" not in outcomes[0]
    assert {name: getattr(dist, name) for name in originals} == originals
    assert dist.distributed_c10d.all_reduce is originals["all_reduce"]
