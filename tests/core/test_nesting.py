"""The nesting counter hot paths read (core/nesting.py): depth, truth, and unwinding on an exception."""

import pytest

from lightning_opkit.core.nesting import Nesting


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
