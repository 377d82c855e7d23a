"""A window's roofline (profiler/roofline/report.py), Trainer-free: MFU as the FLOPs over the step against each dtype's
peak, computed here by hand; the worst class; build_report from a real profile."""

import pytest
import torch
from helpers import profiled
from torch import nn

from lightning_opkit.core.facts import RunFacts
from lightning_opkit.profiler.roofline.peaks import Peaks
from lightning_opkit.profiler.roofline.report import RooflineReport, build_report
from lightning_opkit.profiler.roofline.work import ClassRoofline


def test_mfu_charges_each_dtype_at_its_own_peak():
    rows = {"matmul": ClassRoofline("matmul", {"fp32": 2e12, "bf16": 8e12}, bytes=1e9, seconds=1.0, calls=4),
            "norm": ClassRoofline("norm", {}, bytes=1e9, seconds=0.5, calls=4)}
    report = RooflineReport(rows, Peaks("cpu", {"fp32": 2.0, "bf16": 8.0}, 100.0), steps=1, step_seconds=4.0)
    assert report.model_flops_by_dtype() == {"fp32": 2e12, "bf16": 8e12}
    assert report.mfu() == pytest.approx(100 * (2e12 / 2e12 + 8e12 / 8e12) / 4.0)  # 1 s + 1 s of peak work in 4 s
    assert report.mfu(against="fp32") == pytest.approx(100 * 10e12 / 2e12 / 4.0)
    assert report.mfu(against="fp16") is None  # no peak measured for it
    assert RooflineReport({}, report.peaks, steps=1, step_seconds=1.0).mfu() is None


def test_build_report_from_a_real_profile_fills_the_run_s_facts():
    torch.manual_seed(0)
    mlp, x = nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256)), torch.randn(64, 256)
    facts = RunFacts()
    report = build_report(profiled(lambda: mlp(x).sum().backward()), steps=1, step_seconds=0.01, device="cpu",
                          facts=facts, window=2)
    assert {"matmul", "norm"} <= set(report.rows)
    assert report.peaks is facts.peaks
    assert report.peaks.gemm_tflops["fp32"] > 0
    assert facts.speeds[("matmul", "bf16")].source == "measured by the roofline in window 2"
    assert report.worst() is not None
    assert report.worst().op_class != "communication"
