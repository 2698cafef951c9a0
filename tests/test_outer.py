"""The outer Nesterov step on the averaged pseudo-gradient: its arithmetic, and the scheme around the all-reduce
(a one-rank gloo group: the averaging is then the identity and only the outer step moves the model)."""

from __future__ import annotations

import pytest
import torch
from conftest import meeting
from torch import nn

from lightning_oscars import OscarsStrategy
from lightning_oscars.dist.averaging import averaged_tensors
from lightning_oscars.dist.outer import OuterNesterovAveraging, outer_nesterov_step


def test_outer_step_is_nesterov_sgd_on_the_pseudo_gradient():
    start, avg, m = [torch.tensor([1.0, 2.0])], [torch.tensor([0.5, 2.5])], [torch.tensor([0.1, 0.0])]
    outer_nesterov_step(start, avg, m, lr=0.7, mu=0.9)
    g = torch.tensor([0.5, -0.5])
    m_new = 0.9 * torch.tensor([0.1, 0.0]) + g
    expected = torch.tensor([1.0, 2.0]) - 0.7 * (g + 0.9 * m_new)
    assert torch.allclose(m[0], m_new) and torch.allclose(start[0], expected) and torch.allclose(avg[0], expected)
    # lr 1, no momentum: the plain average
    start, avg, m = [torch.tensor([1.0])], [torch.tensor([0.25])], [torch.zeros(1)]
    outer_nesterov_step(start, avg, m, lr=1.0, mu=0.0)
    assert avg[0].item() == start[0].item() == 0.25


def test_scheme_applies_the_outer_step_to_trainable_parameters_only(one_rank_group):
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model[0].bias.requires_grad_(False)
    scheme = OuterNesterovAveraging(lr=0.5, mu=0.5)
    scheme.bind(p for p in model.parameters() if p.requires_grad)
    tensors = averaged_tensors(model)
    control = [1.0]
    scheme.combine(tensors, meeting(control))  # the first averaging sets the start point
    start = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.add_(-1.0)  # local progress of one round: pseudo-gradient +1 everywhere
        model[1].running_mean.add_(3.0)
    scheme.combine(tensors, meeting(control))
    # g = 1, m = 1, x = start - 0.5 * (1 + 0.5 * 1) = start - 0.75: more than the plain average's 0.5 ... 1.0 step
    assert torch.allclose(model[0].weight, start - 0.75)
    assert torch.allclose(model[1].running_mean, torch.full((2,), 3.0))  # buffers: averaged only
    state = scheme.state_dict()
    resumed = OuterNesterovAveraging(lr=0.5, mu=0.5)
    resumed.bind(p for p in model.parameters() if p.requires_grad)
    resumed.load_state_dict(state)
    with torch.no_grad():
        model[0].weight.add_(-1.0)
    here = model[0].weight.detach().clone()
    resumed.combine(tensors, meeting(control))
    # the momentum survived the checkpoint: m = 0.5 * 1 + 1 = 1.5, step = 0.5 * (1 + 0.75)
    assert torch.allclose(model[0].weight, here + 1.0 - 0.875)


@pytest.mark.parametrize(("option", "value"), [("outer_lr", 0.0), ("outer_lr", -1.0), ("outer_momentum", 1.0)])
def test_bad_outer_options_are_rejected_naming_them(option, value):
    with pytest.raises(ValueError, match=option):
        OscarsStrategy(**{option: value})


def test_strategy_option_selects_the_scheme():
    assert type(OscarsStrategy().make_scheme()).__name__ == "ModelAveraging"
    scheme = OscarsStrategy(outer_lr=0.7).make_scheme()
    assert isinstance(scheme, OuterNesterovAveraging) and (scheme.lr, scheme.mu) == (0.7, 0.9)
