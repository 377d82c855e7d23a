"""Patches (core/patch.py): what a callback sets on a model is put back, however often it is restored."""

import pytest
import torch
from torch import nn

from lightning_opkit.core.patch import Nesting, Patches


def test_patches_restore_idempotently():
    module = nn.Linear(2, 2)
    patches = Patches()
    patches.set(module, "forward", lambda x: x)
    patches.hold(module.register_forward_hook(lambda *a: None))
    assert torch.equal(module(torch.ones(1, 2)), torch.ones(1, 2))
    patches.restore()
    patches.restore()
    assert "forward" not in vars(module)
    assert not module._forward_hooks


# The nesting counter hot paths read (core/patch.py): depth, truth, and unwinding on an exception.


def _fail_inside_two(scope: Nesting, depths: list[int]) -> None:
    with scope.scope(), scope.scope():
        depths.append(scope.depth)
        raise ValueError("inside")


def test_depth_counts_nested_scopes_and_unwinds_on_an_exception():
    scope = Nesting()
    assert scope.depth == 0
    assert not scope
    depths: list[int] = []
    with pytest.raises(ValueError, match="inside"):
        _fail_inside_two(scope, depths)
    assert depths == [2]
    assert scope.depth == 0
    with scope.scope():
        assert scope


def test_two_counters_are_independent():
    a, b = Nesting(), Nesting()
    with a.scope():
        assert a.depth == 1
        assert b.depth == 0
