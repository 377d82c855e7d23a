"""The ops a step runs (precision/oplog.py): one example per (op, input shapes), counted as often as it ran, checked
against a plain count of the same forward by a function mode of this test's own."""

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from lightning_opkit.precision.oplog import OpLog, Stat


class _Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: dict = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[func] = self.calls.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def _net():
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3), nn.BatchNorm1d(3))


def test_each_op_and_shape_is_kept_once_and_counted_as_often_as_it_ran():
    net, x = _net(), torch.randn(4, 8)
    with OpLog() as log:
        net(x)
    with _Count() as plain:
        net(x)
    by_func: dict = {}
    for (func, _), count in log.counts.items():
        by_func[func] = by_func.get(func, 0) + count
    assert by_func[F.linear] == plain.calls[F.linear] == 3
    assert by_func[F.gelu] == plain.calls[F.gelu] == 2
    linear_shapes = [sig for (func, sig) in log.examples if func is F.linear]
    assert len(linear_shapes) == 2  # 8 -> 8 twice under one key, 8 -> 3 under another
    cls, func, args, kwargs = log.examples[(F.linear, linear_shapes[0])]
    assert (cls, func) == ("matmul", F.linear)
    assert not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)  # detached examples


def test_running_statistics_are_kept_as_clones_the_timing_cannot_write_into():
    net = _net()
    with OpLog() as log:
        net(torch.randn(4, 8))
    (norm_key,) = [k for k, (cls, *_) in log.examples.items() if cls == "norm"]
    _, _, args, kwargs = log.examples[norm_key]
    stats = [a for a in [*args, *kwargs.values()] if isinstance(a, Stat)]
    assert len(stats) == 2  # running mean and variance
    assert all(s.data_ptr() not in (net[5].running_mean.data_ptr(), net[5].running_var.data_ptr()) for s in stats)


def test_a_backward_inside_the_recorded_step_is_not_an_op_to_time():
    net = nn.Linear(8, 8)
    with OpLog() as log:
        net(torch.randn(2, 8)).sum().backward()  # a manually optimized step calls backward inside
    assert {cls for cls, *_ in log.examples.values()} == {"matmul", "reduction"}
