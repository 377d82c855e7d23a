"""The roofline: measured peaks, work per op class from real profiler runs, bounds, levers, and what a run logs."""

import io
import re

import helpers
import numpy as np
import pytest
import torch
from helpers import flop_counter, read_events, read_images, read_layout
from PIL import Image
from torch import nn
from zoo import build

from lightning_opkit import ProfilerWindows
from lightning_opkit.core.facts import facts_of
from lightning_opkit.profiler.roofline.levers import lever as lever_of

# ---- in a real run: logged per window, read back from the event files


def _fit(tmp_path, model, callbacks, steps):
    trainer = helpers.trainer(tmp_path, callbacks, max_steps=steps)
    trainer.fit(model, model.loader(n=96))  # every case has more than `steps` batches in its one epoch
    return trainer


def _training_step_flops(model, batch):
    with flop_counter() as counter:
        model.case.loss(model.model, batch).backward()
    model.model.zero_grad()
    return counter.get_total_flops()


@pytest.mark.parametrize("case", ["torch_encoder", "hf_gpt2", "bn_cnn"])
def test_roofline_per_window_in_tensorboard_scalars_table_picture_and_summary(tmp_path, case):
    model = build(case)
    windows = ProfilerWindows(every_n_steps=3, warmup=0, active=2, roofline=True, export_trace=False)
    _fit(tmp_path, model, [windows], steps=8)
    roofline = windows.last_roofline
    scalars, texts = read_events(str(tmp_path))
    gemm = "conv" if case == "bn_cnn" else "matmul"
    # two windows (steps 4-5 and 7-8), each with the class's achieved rates and the step's MFU
    assert [s for s, _ in scalars[f"opkit/profiler/{gemm}/tflops"]] == [5, 8]
    for tail in ("gbps", "pct_peak", "pct_bandwidth", "intensity"):
        assert len(scalars[f"opkit/profiler/{gemm}/{tail}"]) == 2, tail
    row = roofline.rows[gemm]
    assert scalars[f"opkit/profiler/{gemm}/tflops"][-1][1] == pytest.approx(row.tflops, rel=1e-5)
    assert scalars[f"opkit/profiler/{gemm}/pct_peak"][-1][1] == pytest.approx(row.pct_peak(roofline.peaks), rel=1e-5)
    mfu = scalars["opkit/profiler/mfu"][-1][1]
    assert 0 < mfu <= 100
    assert mfu == pytest.approx(scalars["opkit/profiler/mfu_fp32"][-1][1], rel=1e-5)  # everything ran in fp32
    # the step's model FLOPs are those of a forward and backward as FlopCounterMode counts them
    batch = next(iter(model.loader()))
    assert sum(roofline.model_flops_by_dtype().values()) == pytest.approx(_training_step_flops(model, batch),
                                                                          rel=0.02)
    # the table states the peaks and units; every class that ran has a row with its bound and lever
    table = texts["opkit/profiler/roofline"][-1][1]
    assert "Peaks measured on cpu: dense GEMM fp32" in table
    assert "| class | dtype | ms / step | GFLOP / step | MB / step | FLOP / B | TFLOP/s | GB/s |" in table
    for cls in roofline.rows:
        assert f"| {cls} |" in table, cls
    assert "MFU" in table
    # the picture: one per window, a PNG with the roofs and points drawn (not a blank canvas)
    images = read_images(str(tmp_path))["opkit/profiler/roofline_plot"]
    assert [(s, w, h) for s, w, h, _ in images] == [(5, 900, 560), (8, 900, 560)]
    pixels = np.asarray(Image.open(io.BytesIO(images[-1][3])).convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20
    lines = windows.summary_lines()
    assert any(line.strip().startswith("roofline: MFU") for line in lines), lines
    worst = next(line for line in lines if "most time above its roof" in line)
    assert len(re.findall(r"\w+-bound", worst)) == 1, worst  # the bound said once, not in the head and the lever
    layout = read_layout(str(tmp_path))["opkit roofline"]
    assert r"opkit/profiler/[a-z]+/tflops" in layout["achieved TFLOP/s per op class"]


def test_op_class_time_in_the_roofline_is_the_op_class_share_time(tmp_path):
    model = build("torch_encoder")
    windows = ProfilerWindows(every_n_steps=3, warmup=0, active=1, roofline=True, export_trace=False)
    _fit(tmp_path, model, [windows], steps=4)
    report, roofline = windows.last_report, windows.last_roofline
    for cls, us in report.class_self_us.items():
        if cls in ("other", "layout", "communication") or us == 0:
            continue
        row = roofline.rows[cls]
        assert 1e6 * (row.seconds + row.unknown_seconds) == pytest.approx(us, rel=1e-6, abs=1e-3), cls


# ---- the lever: only what the measurement supports


class Wide(helpers.pl.LightningModule):
    """A wide MLP: its GEMMs (128 x 512 x 2048) are compute-bound on any CPU."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_the_roofline_times_bf16_at_the_windows_own_gemm_shapes_without_a_policy(tmp_path):
    torch.manual_seed(0)
    windows = ProfilerWindows(every_n_steps=3, warmup=0, active=1, roofline=True, export_trace=False)
    trainer = helpers.trainer(tmp_path, [windows], max_steps=4)
    trainer.fit(Wide(), helpers.make_loader(n=512, dim=512, batch_size=128))
    fact = facts_of(trainer).speeds[("matmul", "bf16")]
    assert fact.source == "measured by the roofline in window 1"
    assert "128x2048@2048x512" in fact.shapes or "128x512@512x2048" in fact.shapes
    roofline = windows.last_roofline
    matmul = roofline.rows["matmul"]
    assert matmul.bound(roofline.peaks)[0] == "compute"
    lever = lever_of(matmul, roofline)
    assert fact.phrase() in lever  # the lever names what it rests on, whichever way it came out here
    # and never suggests what the measurement contradicts
    assert ("PrecisionPolicy(rules={'matmul': 'bf16'})" in lever) == (fact.ratio * 1.05 <= 1)
    table = texts_of(tmp_path)["opkit/profiler/roofline"][-1][1]
    assert fact.phrase() in table


def test_roofline_option_is_checked_and_turns_on_shapes_and_flops():
    with pytest.raises(ValueError, match="roofline"):
        ProfilerWindows(roofline="yes")
    windows = ProfilerWindows(roofline=True)
    assert windows._profile_options["record_shapes"]
    assert windows._profile_options["with_flops"]


# ---- under compile: Inductor's fused kernels count with their class


def test_inductor_fused_kernels_count_their_time_with_their_class_and_are_not_told_to_fuse(tmp_path):
    from compile.test_torch_compile import Blocks

    from lightning_opkit import TorchCompile

    windows = ProfilerWindows(every_n_steps=4, warmup=1, active=2, roofline=True, export_trace=False)
    model = Blocks(depth=2)
    trainer = helpers.trainer(tmp_path, [TorchCompile(modules=["blocks.*"], measure=False), windows], max_steps=8)
    trainer.fit(model, helpers.make_loader(n=96, dim=8))
    report, roofline = windows.last_report, windows.last_roofline
    fused = {cls: row for cls, row in roofline.rows.items() if row.unknown_calls}
    assert fused, roofline.rows  # LayerNorm, GELU and the residual add ran as cpp_fused_* kernels
    assert roofline.compiled
    for cls, row in fused.items():
        # the class's time is the op-class share's time, fused kernels included
        assert 1e6 * (row.seconds + row.unknown_seconds) == pytest.approx(report.class_self_us[cls], rel=1e-6), cls
        assert "fuse it" not in lever_of(row, roofline), lever_of(row, roofline)
    # the GEMMs stay extern kernels (aten::addmm / mm) with shapes: their FLOPs are counted
    assert roofline.rows["matmul"].flops > 0
    table = texts_of(tmp_path)["opkit/profiler/roofline"][-1][1]
    assert "Inductor's fused kernels" in table


def texts_of(tmp_path):
    return read_events(str(tmp_path))[1]


# ---- the dtype mix: each dtype's FLOPs against its own measured peak


def test_mfu_charges_each_dtype_at_its_own_peak_under_a_precision_policy(tmp_path):
    from lightning_opkit import PrecisionPolicy

    model = build("torch_encoder")
    policy = PrecisionPolicy(rules={"matmul": "bf16"}, census_every_n_steps=0, measure=False)
    windows = ProfilerWindows(every_n_steps=3, warmup=0, active=1, roofline=True, export_trace=False)
    _fit(tmp_path, model, [policy, windows], steps=4)
    roofline = windows.last_roofline
    peaks = roofline.peaks
    matmul = roofline.rows["matmul"]
    assert matmul.dtype.startswith("bf16")  # the policy's GEMMs ran in bf16, and the roofline read it off the ops
    assert matmul.flops_by_dtype["bf16"] > 0
    flops = roofline.model_flops_by_dtype()
    expected = 100 * sum(f / (peaks.gemm_tflops[d] * 1e12) for d, f in flops.items()) / roofline.step_seconds
    assert roofline.mfu() == pytest.approx(expected)
    assert roofline.mfu("fp32") == pytest.approx(100 * sum(flops.values()) / (peaks.gemm_tflops["fp32"] * 1e12)
                                                 / roofline.step_seconds)
    assert matmul.pct_peak(peaks) == pytest.approx(
        100 * sum(f / (peaks.gemm_tflops[d] * 1e12) for d, f in matmul.flops_by_dtype.items()) / matmul.seconds)
    assert "bf16" in texts_of(tmp_path)["opkit/profiler/roofline"][-1][1]


# ---- memory layout, measured: channels_last against contiguous at the model's own convolutions


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_the_roofline_times_the_zoo_cnns_convolutions_in_both_layouts(tmp_path, layout):
    torch.manual_seed(0)
    model = build("bn_cnn")
    if layout == "channels_last":
        model.to(memory_format=torch.channels_last)
    windows = ProfilerWindows(every_n_steps=2, warmup=0, active=1, roofline=True, export_trace=False)
    trainer = helpers.trainer(tmp_path, [windows], max_steps=3)
    trainer.fit(model, model.loader())
    fact = facts_of(trainer).layouts["conv"]
    assert fact.current == layout
    assert fact.source == "measured by the roofline in window 1"
    # the zoo CNN's own convolutions as recorded: the 3->8 stem and the 8->8 blocks on its 8x3x16x16 images
    assert "costliest conv shape" in fact.shapes, fact.shapes
    assert "8x8x3x3" in fact.shapes, fact.shapes
    assert 0 < fact.ratio < 100
    roofline = windows.last_roofline
    lever = lever_of(roofline.rows["conv"], roofline)
    assert fact.phrase() in lever  # whichever way it came out on this machine, the lever says what it rests on
    faster = fact.ratio * 1.05 <= 1
    assert ("model.to(memory_format=torch.channels_last)" in lever) == (faster and layout == "contiguous")
    assert ("memory_format=torch.contiguous_format" in lever) == (fact.ratio > 1.05 and layout == "channels_last")
    assert fact.phrase() in texts_of(tmp_path)["opkit/profiler/roofline"][-1][1]


