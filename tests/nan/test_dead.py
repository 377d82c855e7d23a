"""The dead-parameter watch (nan/dead.py) without a Trainer: through the step's own check (nan/check.py), a parameter
with no gradient, or an all-zero one, for ``after`` checked steps is named once, with its module; an MoE expert by
index."""

import functools

import torch
from torch import nn

from lightning_opkit.nan.check import check
from lightning_opkit.nan.dead import DeadWatch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)  # a branch the forward no longer takes
        self.zeroed = nn.Linear(4, 1)

    def forward(self, x):
        return self.used(x).sum() + 0 * self.zeroed(x).sum()


def _steps(model, watch, n):
    """``n`` checked steps, as NaNDetector checks them; the steps whose check raised the dead flag."""
    flagged = []
    for step in range(n):
        model.zero_grad(set_to_none=True)
        loss = model(torch.ones(2, 4))
        loss.backward()
        params = list(model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        checked = check([loss.detach()], grads, torch.device("cpu"), functools.partial(watch.flag, params, step=step))
        if checked.dead:
            flagged.append(step)
    return flagged


def test_after_that_many_steps_the_gradient_free_parameters_are_named_once_each():
    model, watch = Net(), DeadWatch(after=3)
    watch.start(model)
    assert _steps(model, watch, 2) == []  # not yet
    assert _steps(model, watch, 1) == [0]  # the third step in a row raises the flag
    new = watch.newly_dead(model)
    assert {(d.parameter, d.what) for d in new} == {
        ("unused.weight", "no gradient"), ("unused.bias", "no gradient"),
        ("zeroed.weight", "all-zero gradient"), ("zeroed.bias", "all-zero gradient")}
    assert {d.module for d in new} == {"unused", "zeroed"}
    assert watch.newly_dead(model) == []  # named once
    assert "unused.weight" in watch.warning(new)


def test_a_parameter_frozen_on_purpose_is_listed_but_not_warned_about():
    model, watch = Net(), DeadWatch(after=1)
    for p in model.unused.parameters():
        p.requires_grad_(False)
    model.zeroed.requires_grad_(False)
    watch.start(model)
    _steps(model, watch, 1)
    new = watch.newly_dead(model)
    assert new
    assert all(d.frozen for d in new)
    assert watch.warning(new) is None


def test_a_fused_expert_weight_is_watched_expert_by_expert():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4, 3))  # 4 experts

        def forward(self, x):
            return sum((x @ self.w[e]).sum() for e in (0, 1, 3))  # expert 2 gets no token

    model, watch = Experts(), DeadWatch(after=2)
    watch.start(model)
    _steps(model, watch, 2)
    assert [(d.parameter, d.expert) for d in watch.newly_dead(model)] == [("w", 2)]
