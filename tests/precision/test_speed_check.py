"""Explicit rules' speed check (precision/speed_check.py): the lowered classes timed, and a warning exactly where a
measured row is slower than fp32 by more than the kit's bar, whatever this machine's bf16 speed."""

import warnings

import torch
from torch import nn

from lightning_opkit.core.warn import new_run
from lightning_opkit.precision.decide import MIN_SPEEDUP
from lightning_opkit.precision.oplog import OpLog
from lightning_opkit.precision.speed_check import check_speed, lowered


def test_lowered_lists_the_16_bit_classes_in_taxonomy_order():
    assert lowered({"norm": "bf16", "matmul": "fp16", "softmax": "fp32", "loss": "keep"}) == ["matmul", "norm"]


def test_the_warning_names_exactly_the_classes_measured_slower():
    net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64))
    with OpLog() as log:
        net(torch.randn(16, 64))
    new_run()  # warn_once remembers per run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        measured = check_speed(log, torch.device("cpu"), {"matmul": "bf16", "norm": "bf16", "activation": "fp32"})
    assert measured is not None
    assert sorted((r.op_class, r.dtype) for r in measured) == [("matmul", "bf16"), ("norm", "bf16")]
    slow = sorted(r.op_class for r in measured if r.time_ratio > MIN_SPEEDUP)
    text = " ".join(str(w.message) for w in caught if "PrecisionPolicy: on this device" in str(w.message))
    assert sorted(c for c in ("matmul", "norm") if f"bf16 {c} is" in text) == slow
    assert bool(text) == bool(slow)
