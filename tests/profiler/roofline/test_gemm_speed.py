"""bf16 against fp32 at a window's own GEMM shapes (profiler/roofline/gemm_speed.py), Trainer-free: the shapes the fact
names are the costliest ones the profile recorded, read independently from the same events."""

import ast

import torch
from helpers import profiled
from torch import nn

from lightning_opkit.profiler.roofline.gemm_speed import gemm_speed


def test_the_fact_names_the_costliest_gemm_shapes_the_profile_recorded():
    torch.manual_seed(0)
    mlp, x = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)), torch.randn(64, 256)
    prof = profiled(lambda: mlp(x).sum().backward())
    fact = gemm_speed(prof, "cpu", window=3)
    assert fact.source == "measured by the roofline in window 3"
    assert (fact.op_class, fact.dtype) == ("matmul", "bf16")
    assert fact.ratio > 0  # a timing: what it came to is this machine's, and no test's to pin down
    # the shapes it names are the profile's own three costliest GEMM shapes, read here from the same events
    spent: dict[tuple[str, str], float] = {}
    for e in prof.events():
        if e.key in ("aten::mm", "aten::addmm") and e.input_shapes:
            key = (e.key, str(e.input_shapes))
            spent[key] = spent.get(key, 0.0) + e.self_cpu_time_total
    costliest = sorted(spent, key=lambda k: -spent[k])[:3]
    assert f"this model's {len(costliest)} costliest GEMM shapes" in fact.shapes
    for op, shapes in costliest:
        dims = ast.literal_eval(shapes)  # the profiler's list of input shapes, as str() printed them
        first = 0 if op == "aten::mm" else 1  # addmm's first input is its bias
        assert "@".join("x".join(map(str, d)) for d in dims[first:first + 2]) in fact.shapes


def test_no_fact_without_an_fp32_gemm():
    x = torch.randn(64, 64, requires_grad=True)
    assert gemm_speed(profiled(lambda: x.relu().sum().backward()), "cpu", window=0) is None
    low = nn.Linear(64, 64).bfloat16()
    assert gemm_speed(profiled(lambda: low(torch.randn(8, 64).bfloat16()).sum().backward()), "cpu", window=0) is None
