"""This device's measured peaks (profiler/roofline/peaks.py) and the bounds they give, Trainer-free: a wide GEMM
compute-bound, LayerNorm memory-bound, a disturbed peak measured again."""

import torch
from helpers import profiled
from torch import nn

from lightning_opkit.profiler.roofline.peaks import Peaks, checked_peaks, measure_peaks
from lightning_opkit.profiler.roofline.work import achieved_rates, class_rooflines


def test_a_wide_gemm_is_compute_bound_and_norm_gelu_memory_bound_against_measured_peaks():
    peaks = measure_peaks("cpu", ("fp32",))
    assert peaks.gemm_tflops["fp32"] > 0
    assert peaks.bandwidth_gbps > 0
    torch.manual_seed(0)
    mlp, x = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)), torch.randn(512, 1024)
    matmul = class_rooflines(profiled(lambda: mlp(x).sum().backward()))["matmul"]
    kind, pct = matmul.bound(peaks)
    assert matmul.dtype == "fp32"
    assert matmul.intensity > 100  # FLOPs per byte: far right of the ridge
    assert kind == "compute", (kind, pct)
    # of the measured fp32 GEMM peak, both timed on a shared 2-core machine: the right order of magnitude is what a
    # FLOP count off by a factor of ten would miss, and what load cannot flip (seen 19-60% here)
    assert pct > 2, pct
    ln = nn.Sequential(nn.LayerNorm(1024), nn.GELU(), nn.LayerNorm(1024), nn.GELU())
    y = torch.randn(4096, 1024, requires_grad=True)
    rows = class_rooflines(profiled(lambda: ln(y).sum().backward()))
    # as a window's report does: a peak an op class outran (measured while the machine was busy) is measured again
    peaks = checked_peaks(peaks, achieved_rates(rows), "cpu")
    for cls in ("norm", "activation"):
        assert rows[cls].intensity < 5, rows[cls]
        assert rows[cls].bound(peaks)[0] == "memory", rows[cls].bound(peaks)  # big ops: by intensity, not by speed
    assert rows["norm"].bound(peaks)[0] == "memory"


def test_a_peak_measured_on_a_busy_machine_is_measured_again_before_a_verdict_rests_on_it():
    """A fp32 peak a thousand times too low (as if taken while other work held the cores) judged LayerNorm
    compute-bound; checked against what the window's classes reached, it is measured again and the verdict is the
    bytes' one. A rate no measurement reaches leaves the peak named as disturbed."""
    ln = nn.Sequential(nn.LayerNorm(1024), nn.GELU(), nn.LayerNorm(1024), nn.GELU())
    y = torch.randn(4096, 1024, requires_grad=True)
    rows = class_rooflines(profiled(lambda: ln(y).sum().backward()))
    busy = Peaks("cpu", {"fp32": 1e-6}, measure_peaks("cpu", ("fp32",)).bandwidth_gbps, {"fp32": 256})
    assert rows["norm"].bound(busy)[0] == "compute"  # the wrong verdict a disturbed peak gives
    checked = checked_peaks(busy, achieved_rates(rows), "cpu")
    assert checked.gemm_tflops["fp32"] > 1e-3
    assert checked.disturbed == {}
    assert rows["norm"].bound(checked)[0] == "memory"
    impossible = checked_peaks(busy, {"fp32": 1e6}, "cpu", tries=1)
    assert "fp32" in impossible.disturbed
    assert "fp32's peak looks disturbed (an op class ran at 1e+06 TFLOP/s, above it)" in impossible.describe()
