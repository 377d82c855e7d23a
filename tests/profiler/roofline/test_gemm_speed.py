"""bf16 against fp32 at a window's own GEMM shapes (profiler/roofline/gemm_speed.py), Trainer-free: the shapes the fact
names are the ones the profile recorded, and its ratio is what timing those shapes directly gives, within noise."""

import torch
from helpers import profiled
from torch import nn

from lightning_opkit.core.timing import best_seconds
from lightning_opkit.profiler.roofline.gemm_speed import gemm_speed


def test_the_fact_names_the_recorded_gemm_shapes_and_its_ratio_is_theirs():
    torch.manual_seed(0)
    mlp, x = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)), torch.randn(64, 256)
    fact = gemm_speed(profiled(lambda: mlp(x).sum().backward()), "cpu", window=3)
    assert fact.source == "measured by the roofline in window 3"
    assert (fact.op_class, fact.dtype) == ("matmul", "bf16")
    assert "64x256@256x512" in fact.shapes  # the first Linear's forward GEMM, as addmm recorded it
    assert fact.ratio > 0
    # timed directly: the same GEMM in both dtypes, within a factor of 4 of the fact's ratio (loose, because a busy
    # machine moves either timing; what it catches is a fact timed at other shapes or with the ratio upside down
    # where bf16 is emulated, as on an AVX2 CPU, 10x or more away)
    a, b = torch.randn(64, 256), torch.randn(256, 512)
    fp32 = best_seconds(lambda: a @ b, "cpu", reps=5, calls=10)
    low = best_seconds(lambda: a.bfloat16() @ b.bfloat16(), "cpu", reps=5, calls=10)
    assert fact.ratio / 4 < low / fp32 < fact.ratio * 4


def test_no_fact_without_an_fp32_gemm():
    x = torch.randn(64, 64, requires_grad=True)
    assert gemm_speed(profiled(lambda: x.relu().sum().backward()), "cpu", window=0) is None
    low = nn.Linear(64, 64).bfloat16()
    assert gemm_speed(profiled(lambda: low(torch.randn(8, 64).bfloat16()).sum().backward()), "cpu", window=0) is None
