"""The roofline's parts (issue 19, first part): measured peaks, work per op class from real profiler runs, bounds."""

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from zoo import build

from lightning_opkit._roofline import class_rooflines, measure_peaks


def _profile(step):
    step()  # warm
    with torch.profiler.profile(record_shapes=True, with_flops=True) as prof:
        step()
    return prof


def test_gemm_flops_per_class_equal_flop_counter_modes_on_a_zoo_model():
    model = build("torch_encoder")
    batch = next(iter(model.loader()))

    def step():
        model.model.zero_grad()
        model.case.loss(model.model, batch).backward()

    with FlopCounterMode(display=False) as counter:
        step()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    gemm = sum(v for k, v in counts.items() if k in ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"))
    rows = class_rooflines(_profile(step))
    assert gemm > 0
    assert rows["matmul"].flops == gemm  # forward and backward, wrappers (aten::linear) not counted twice
    # the profiler counts no FLOPs for CPU flash attention: they come from q, k shapes
    assert rows["attention"].flops > 0


def test_a_wide_gemm_is_compute_bound_and_norm_gelu_memory_bound_against_measured_peaks():
    peaks = measure_peaks("cpu", ("fp32",))
    assert peaks.gemm_tflops["fp32"] > 0
    assert peaks.bandwidth_gbps > 0
    torch.manual_seed(0)
    mlp, x = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)), torch.randn(512, 1024)
    matmul = class_rooflines(_profile(lambda: mlp(x).sum().backward()))["matmul"]
    kind, pct = matmul.bound(peaks)
    assert matmul.dtype == "fp32"
    assert matmul.intensity > 100  # FLOPs per byte: far right of the ridge
    assert kind == "compute", (kind, pct)
    assert pct > 25, pct  # of the measured fp32 GEMM peak (2 threads, measured at 1024^3 in the same process)
    ln = nn.Sequential(nn.LayerNorm(1024), nn.GELU(), nn.LayerNorm(1024), nn.GELU())
    y = torch.randn(4096, 1024, requires_grad=True)
    rows = class_rooflines(_profile(lambda: ln(y).sum().backward()))
    for cls in ("norm", "activation"):
        assert rows[cls].intensity < 5, rows[cls]
        assert rows[cls].bound(peaks)[0] in ("memory", "overhead"), rows[cls].bound(peaks)
    assert rows["norm"].bound(peaks)[0] == "memory"
