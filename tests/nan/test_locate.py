"""Localization (nan/locate.py) without a Trainer: one replay with hooks names where the first non-finite value came
from (a forward output from finite inputs, a backward input-gradient, the loss), and leaves nothing hooked."""

import pytest
import torch
from torch import nn

from lightning_opkit.core.replay import rng_state
from lightning_opkit.nan.locate import locate


class LogOf(nn.Module):
    """``log(x - shift)``: NaN where ``x < shift``, finite elsewhere."""

    def __init__(self, shift):
        super().__init__()
        self.shift = shift

    def forward(self, x):
        return torch.log(x - self.shift)


class SqrtOfZero(nn.Module):
    """``sqrt(0 * x)``: finite forward (zeros), non-finite backward (0 * inf)."""

    def forward(self, x):
        return torch.sqrt(x * 0)


def _locate(model, loss=lambda out: out.sum(), **kw):
    x = torch.ones(2, 4)
    flags = dict(forward=True, backward=True, loss=True) | kw
    return locate(model, lambda: loss(model(x)), rng_state(), modules=list(model.named_modules()), **flags)


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def test_the_first_module_whose_output_went_non_finite_is_named_not_the_ones_after():
    model = nn.Sequential(nn.Linear(4, 4), LogOf(shift=100.0), nn.Linear(4, 1))
    origin = _locate(model)
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "1", "LogOf")
    assert origin.nan == 8
    assert origin.inf == 0  # every element of its (2, 4) output
    assert _hooks(model) == 0


def test_a_backward_that_makes_an_input_gradient_non_finite_is_named_with_phase_backward():
    model = nn.Sequential(nn.Linear(4, 4), SqrtOfZero(), nn.Linear(4, 1))
    origin = _locate(model)
    assert (origin.phase, origin.module) == ("backward", "1")
    assert _locate(model, backward=False) is None  # the forward is finite: without backward, nothing to name
    assert _hooks(model) == 0


def test_a_loss_that_goes_non_finite_from_a_finite_forward_is_the_loss():
    model = nn.Sequential(nn.Linear(4, 1))
    origin = _locate(model, loss=lambda out: torch.log(-out.abs().sum() - 1))
    assert (origin.phase, origin.module, origin.op_class) == ("loss", "", "loss")


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_a_finite_step_names_nothing_and_the_rng_is_replayed_from_the_given_state(dropout):
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(dropout), nn.Linear(4, 1))
    state = rng_state()
    seen = []
    assert locate(model, lambda: seen.append(torch.rand(1)) or model(torch.ones(2, 4)).sum(), state,
                  modules=list(model.named_modules()), forward=True, backward=True, loss=True) is None
    assert seen
    assert all(torch.equal(s, seen[0]) for s in seen)  # every replay drew the same numbers
