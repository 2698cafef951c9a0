"""``ParameterServerScheme`` in one process: its server replaced by a recording stand-in, the round's all-reduce on
a one-rank gloo group."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from conftest import meeting
from test_averaging import gloo  # noqa: F401 - the one-rank gloo group fixture
from torch import Tensor, nn

from lightning_oscars.core.staleness import BSP
from lightning_oscars.dist.server_scheme import ParameterServerScheme


class RecordingServer:
    """Stands in for ``ParameterServer``: records every pushed delta and answers with fixed parameters."""

    def __init__(self, answer: Tensor) -> None:
        self.answer = answer
        self.deltas: list[Tensor] = []
        self.rounds_ended = 0

    def push_pull(self, delta: Tensor, busy_s: float = 0.0) -> Tensor:
        self.deltas.append(delta.clone())
        return self.answer.clone()

    def end_round(self) -> None:
        self.rounds_ended += 1

    def pull(self) -> Tensor:
        return self.answer.clone()


def scheme_on(params: Sequence[Tensor], server: RecordingServer) -> ParameterServerScheme:
    scheme = ParameterServerScheme(BSP)
    # bind() without its collective: the parameters and the base they were bound at, then the stand-in server.
    scheme._params = list(params)
    scheme._base = torch.cat([p.detach().reshape(-1).float() for p in params])
    scheme.server = server  # type: ignore[assignment]
    return scheme


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_worker_without_a_step_pushes_an_exact_zero(dtype):
    # 1 + 1e-4 is not representable in bf16 or fp16: loading it rounds, and that rounding is no update.
    server = RecordingServer(torch.tensor([1.0 + 1e-4, -3.0 - 1e-4, 0.5]))
    weight = torch.tensor([1.0, -3.0, 0.0], dtype=dtype)
    scheme = scheme_on([weight], server)
    scheme.after_step()  # the parameters were bound unchanged: a zero delta, then the server's values load
    assert weight.float().tolist() != server.answer.tolist(), "the answer must round in this dtype"
    scheme.after_step()  # no optimizer step in between
    assert torch.count_nonzero(server.deltas[1]) == 0, "a worker that took no step pushed a rounding residue"
    with torch.no_grad():
        weight.add_(1.0)
    scheme.after_step()
    assert torch.equal(server.deltas[2], torch.ones(3)), "a real step pushes its own delta, exact here"


def test_float32_parameters_push_the_step_only():
    server = RecordingServer(torch.tensor([0.5, 0.25]))
    weight = torch.zeros(2)
    scheme = scheme_on([weight], server)
    scheme.after_step()
    with torch.no_grad():
        weight.sub_(0.125)
    scheme.after_step()
    assert torch.equal(server.deltas[1], torch.full((2,), -0.125))


def test_a_buffer_less_model_meets_with_the_control_data_only(gloo):  # noqa: F811 - the fixture
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    assert not list(model.buffers())
    params = list(model.parameters())
    server_state = torch.cat([p.detach().reshape(-1) for p in params]) + 1.0
    server = RecordingServer(server_state)
    scheme = scheme_on(params, server)
    scheme.group = gloo
    met = meeting([2.0, 64.0, 0.0], group=gloo)
    scheme.combine(params, met)
    assert met._summed == [2.0, 64.0, 0.0], "the control data rode in the scheme's all-reduce over the (one) rank"
    assert server.rounds_ended == 1
    loaded = torch.cat([p.detach().reshape(-1) for p in params])
    assert torch.equal(loaded, server_state), "every rank continues from the server's parameters"
