"""An option of ``oscars`` that a paradigm cannot serve is refused when the strategy is built, naming the option and
the way out, instead of being ignored (the paradigm's scheme replaces the one it configures) or breaking a round."""

from __future__ import annotations

import pytest

from lightning_oscars.lightning.paradigms import PARADIGMS

SERVER = ("bsp", "asp", "ssp", "dssp", "dasp")
REFUSED_EVERYWHERE = {
    "overlap_averaging": True,
    "outer_lr": 0.7,
    "outer_momentum": 0.5,
    "deadline_rounds": False,
}


@pytest.mark.parametrize("option", sorted(REFUSED_EVERYWHERE))
@pytest.mark.parametrize("paradigm", [*SERVER, "ripples"])
def test_an_option_no_paradigm_serves_is_refused_naming_it(paradigm: str, option: str) -> None:
    strategy_class = PARADIGMS[paradigm][0]
    with pytest.raises(ValueError, match=rf"strategy='{paradigm}' does not take {option}=.*strategy='oscars'"):
        strategy_class(**{option: REFUSED_EVERYWHERE[option]})


@pytest.mark.parametrize("paradigm", SERVER)
def test_pinned_local_steps_are_refused_on_the_server_and_step_times_suggested(paradigm: str) -> None:
    with pytest.raises(ValueError, match=rf"strategy='{paradigm}' does not take local_steps=.*Pin step_times"):
        PARADIGMS[paradigm][0](local_steps=(4, 1))
    strategy = PARADIGMS[paradigm][0](step_times=(0.01, 0.03))  # deadline rounds sized from them: served
    assert tuple(strategy.pinned_step_times) == (0.01, 0.03)


def test_options_the_paradigms_serve_are_still_taken() -> None:
    ripples = PARADIGMS["ripples"][0](local_steps=(4, 1))  # ripples does not wait on anybody: plain rounds serve it
    assert tuple(ripples.pinned_local_steps) == (4, 1)
    bsp = PARADIGMS["bsp"][0](average_optimizer_state=True, warmup_steps=2, max_local_steps=8)
    assert (bsp.average_optimizer_state, bsp.warmup_steps, bsp.max_local_steps) == (True, 2, 8)
    ssp = PARADIGMS["ssp"][0](staleness=2, solver="alg1", averaging="samples")
    assert (ssp.staleness, ssp.solver, ssp.averaging) == (2, "alg1", "samples")


def test_the_base_classes_cannot_be_built_and_say_what_a_paradigm_defines() -> None:
    from lightning_oscars import ParameterServerStrategy, StepSyncStrategy

    with pytest.raises(TypeError, match="abstract class StepSyncStrategy .*validate"):
        StepSyncStrategy()
    with pytest.raises(TypeError, match="abstract class ParameterServerStrategy .*make_rule"):
        ParameterServerStrategy()


@pytest.mark.parametrize("bad", [-0.5, 1.0, "0.9", True])
@pytest.mark.parametrize("paradigm", SERVER)
def test_a_bad_server_momentum_is_refused_naming_it(paradigm: str, bad: object) -> None:
    with pytest.raises(ValueError, match=r"server_momentum must be a number in \[0, 1\)"):
        PARADIGMS[paradigm][0](server_momentum=bad)
    assert PARADIGMS[paradigm][0](server_momentum=0.9).server_momentum == 0.9


def test_ripples_has_no_server_and_refuses_server_momentum() -> None:
    with pytest.raises((ValueError, TypeError), match="server_momentum"):
        PARADIGMS["ripples"][0](server_momentum=0.9)


def test_an_unknown_option_is_an_error_naming_where_it_belongs() -> None:
    from lightning_oscars import OscarsStrategy

    with pytest.raises(TypeError, match="server_momentum=0.9: it is an option of the parameter-server strategies"):
        OscarsStrategy(server_momentum=0.9)
    with pytest.raises(TypeError, match="max_local_step=8: neither this strategy's nor DDP's"):
        OscarsStrategy(max_local_step=8)
