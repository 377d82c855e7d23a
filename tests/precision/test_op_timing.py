"""Each op class timed at a step's shapes (precision/op_timing.py): one row per class and dtype, weighted by the calls
the log counted."""

import torch
from torch import nn

from lightning_opkit.precision.op_timing import time_classes
from lightning_opkit.precision.oplog import OpLog


def _log(net, x):
    with OpLog() as log:
        net(x).sum().backward()
    return log


def test_rows_per_class_and_dtype_with_calls_and_time():
    net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64))
    log = _log(net, torch.randn(32, 64))
    rows = time_classes(log, torch.device("cpu"), ["bf16"], classes=["matmul", "norm"], reps=1)
    assert [(r.op_class, r.dtype) for r in rows] == [("matmul", "bf16"), ("norm", "bf16")]
    matmul = rows[0]
    assert matmul.calls == 2
    assert matmul.fp32_ms > 0
    assert matmul.time_ratio > 0
    assert matmul.failed is None


def test_a_class_not_in_the_log_gives_no_row_and_classes_can_be_left_out():
    log = _log(nn.Linear(8, 8), torch.randn(2, 8))
    assert [r.op_class for r in time_classes(log, torch.device("cpu"), ["bf16"], reps=1)] == ["matmul", "reduction"]
    assert time_classes(log, torch.device("cpu"), ["bf16"], classes=["conv"], reps=1) == []
