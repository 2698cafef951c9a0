"""The round's layout check (``lightning/round_tensors.py``, ``dist/layouts.py``) and what a fit's patch of a user's
method leaves in a copy (``lightning/patches.py``), in-process; the multi-process behaviour is in
``test_loader_shapes_multiprocess.py``."""

from __future__ import annotations

import copy
import pickle

import torch
from torch import nn

from lightning_oscars.core._nn_state import persistent_buffers
from lightning_oscars.dist.averaging import averaged_tensors
from lightning_oscars.dist.layouts import describe_mismatch
from lightning_oscars.lightning.patches import MethodPatch, Patches
from lightning_oscars.lightning.round_tensors import RoundLayout


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.norm = nn.BatchNorm1d(3)
        self.register_buffer("mask", torch.ones(4, 4), persistent=False)
        self.register_buffer("scale", torch.ones(3))

    def describe(self) -> str:
        return "the module's own"


def test_only_persistent_buffers_are_averaged():
    module = Masked()
    assert [b.shape for b in persistent_buffers(module)] == [(3,), (3,), (3,), ()]  # scale, BatchNorm's three
    assert not any(t is module.mask for t in averaged_tensors(module))


def test_a_rank_whose_shapes_changed_sends_zeros_of_the_agreed_ones_and_a_flag():
    model = [torch.ones(3), torch.ones(8, 8)]
    layout = RoundLayout(sharded=False)
    layout.record(model)
    rest = [torch.ones(2)]  # optimizer state: not checked
    sent, flag = layout.to_send(model + rest, 2, torch.device("cpu"))
    assert flag == 0.0 and all(a is b for a, b in zip(sent, model + rest))  # unchanged: the tensors themselves
    changed = [torch.ones(3), torch.ones(5, 5)]
    sent, flag = layout.to_send(changed + rest, 2, torch.device("cpu"))
    assert flag == 1.0 and [tuple(t.shape) for t in sent] == [(3,), (8, 8), (2,)]  # the buffer keeps its length
    assert float(sent[1].abs().sum()) == 0.0 and sent[2] is rest[0]
    assert RoundLayout(sharded=True).to_send(changed, 2, torch.device("cpu"))[1] == 0.0  # shards: not checked


def test_the_mismatch_names_each_differing_tensor_and_each_ranks_shape():
    names = {0: "parameter 'w'", 1: "buffer 'attention_mask'"}
    message = describe_mismatch([[(3,), (8, 8)], [(3,), (5, 5)]], names.__getitem__)
    assert "buffer 'attention_mask': (8, 8) on rank 0, (5, 5) on rank 1" in message
    assert "parameter 'w'" not in message and "persistent=False" in message


def test_a_patched_method_is_the_objects_own_in_a_copy_or_a_pickle():
    module, patches = Masked(), Patches()
    patches.replace(module, "describe", MethodPatch(lambda: "the fit's", module, "describe"))
    assert module.describe() == "the fit's"
    for other in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert other.describe() == "the module's own"
        assert torch.equal(other.linear.weight, module.linear.weight)
    patches.undo()
    assert module.describe() == "the module's own" and "describe" not in vars(module)
