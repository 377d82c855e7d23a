"""The roofline: measured peaks, work per op class from real profiler runs, bounds, levers, and what a run logs."""

import io

import helpers
import numpy as np
import pytest
import torch
from helpers import read_events, read_images, read_layout
from PIL import Image
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from zoo import build

from lightning_opkit import ProfilerWindows
from lightning_opkit.core.facts import Fp8Fact, RunFacts, SpeedFact, facts_of
from lightning_opkit.profiler.roofline.layout_speed import _step
from lightning_opkit.profiler.roofline.levers import lever as lever_of
from lightning_opkit.profiler.roofline.peaks import Peaks, checked_peaks, measure_peaks
from lightning_opkit.profiler.roofline.report import RooflineReport
from lightning_opkit.profiler.roofline.work import ClassRoofline, achieved_rates, class_rooflines


def _profile(step):
    step()  # warm
    with torch.profiler.profile(record_shapes=True, with_flops=True) as prof:
        step()
    return prof


def _raw(formula):
    def counted(*args, **kwargs):
        return formula(*args, **kwargs)

    counted._get_raw = True  # already shape-wrapped by torch's registration
    return counted


def flop_counter():
    """FlopCounterMode, with its own SDPA formulas applied to CPU's flash attention too (it leaves that op at 0)."""
    aten = torch.ops.aten
    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: _raw(torch.utils.flop_counter.sdpa_flop),
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _raw(torch.utils.flop_counter.sdpa_backward_flop)})


def _counted_and_profiled(case):
    """FlopCounterMode's counts per op and the roofline's rows of one forward and backward of a zoo case."""
    model = build(case)
    batch = next(iter(model.loader()))

    def step():
        model.model.zero_grad()
        model.case.loss(model.model, batch).backward()

    with flop_counter() as counter:
        step()
    return {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}, class_rooflines(_profile(step))


def test_gemm_and_attention_flops_per_class_equal_flop_counter_modes_on_a_zoo_model():
    counts, rows = _counted_and_profiled("torch_encoder")
    gemm = sum(v for k, v in counts.items() if k in ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"))
    attention = sum(v for k, v in counts.items() if "attention" in k)
    assert gemm > 0
    assert attention > 0
    assert rows["matmul"].flops == gemm  # forward and backward, wrappers (aten::linear) not counted twice
    assert rows["attention"].flops == attention  # forward, and backward with its recomputed scores


def test_conv_flops_equal_flop_counter_modes_on_the_zoo_cnn():
    counts, rows = _counted_and_profiled("bn_cnn")
    conv = sum(v for k, v in counts.items() if "convolution" in k)
    assert conv > 0
    assert rows["conv"].flops == conv  # forward (the profiler's) and backward (FlopCounterMode's formula)


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
    # of the measured fp32 GEMM peak, both timed on a shared 2-core machine: the right order of magnitude is what a
    # FLOP count off by a factor of ten would miss, and what load cannot flip (seen 19-60% here)
    assert pct > 2, pct
    ln = nn.Sequential(nn.LayerNorm(1024), nn.GELU(), nn.LayerNorm(1024), nn.GELU())
    y = torch.randn(4096, 1024, requires_grad=True)
    rows = class_rooflines(_profile(lambda: ln(y).sum().backward()))
    # as a window's report does: a peak an op class outran (measured while the machine was busy) is measured again
    peaks = checked_peaks(peaks, achieved_rates(rows), "cpu")
    for cls in ("norm", "activation"):
        assert rows[cls].intensity < 5, rows[cls]
        assert rows[cls].bound(peaks)[0] == "memory", rows[cls].bound(peaks)  # big ops: by intensity, not by speed
    assert rows["norm"].bound(peaks)[0] == "memory"


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
    assert any("most time above its roof" in line for line in lines), lines
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


def _gemm_row():
    torch.manual_seed(0)
    mlp, x = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)), torch.randn(256, 512)
    return class_rooflines(_profile(lambda: mlp(x).sum().backward()))


def _compute_bound_matmul():
    # 1 TFLOP in 2 s against a 1 TFLOP/s fp32 roof: compute-bound at 50%
    peaks = Peaks("cpu", {"fp32": 1.0, "bf16": 4.0}, 100.0)
    return {"matmul": ClassRoofline("matmul", {"fp32": 1e12}, bytes=1e9, seconds=2.0, calls=10)}, peaks


def _lever(facts):
    rows, peaks = _compute_bound_matmul()
    assert rows["matmul"].bound(peaks)[0] == "compute"
    return lever_of(rows["matmul"], RooflineReport(rows, peaks, steps=1, step_seconds=2.0, facts=facts))


def test_precision_lever_rests_on_a_measurement_at_the_models_shapes():
    # a square GEMM peak 4x fp32's is no evidence: without a measurement at the model's shapes, no precision lever
    assert "PrecisionPolicy" not in _lever(None)
    assert "PrecisionPolicy" not in _lever(RunFacts())
    faster = SpeedFact("matmul", "bf16", 0.25, "this model's 3 costliest GEMM shapes", "measured by the roofline")
    lever = _lever(RunFacts(speeds={("matmul", "bf16"): faster}))
    assert "PrecisionPolicy(rules={'matmul': 'bf16'}) or rules='auto'" in lever
    assert faster.phrase() in lever  # the measurement it rests on: value, shapes, who measured it
    slower = SpeedFact("matmul", "bf16", 2.17, "this model's ops", "PrecisionPolicy(rules='auto') at step 0")
    lever = _lever(RunFacts(speeds={("matmul", "bf16"): slower}))
    assert "PrecisionPolicy(rules={'matmul'" not in lever
    assert f"{slower.phrase()}: no precision lever here" in lever


def test_no_precision_lever_for_a_class_the_policy_measured_and_kept_in_fp32():
    # per class bf16 looked faster, but the policy's whole-step measurement kept matmul in fp32: it has the last word
    faster = SpeedFact("matmul", "bf16", 0.5, "this model's ops", "PrecisionPolicy(rules='auto') at step 0")
    facts = RunFacts(speeds={("matmul", "bf16"): faster}, dtypes={"matmul": "fp32"},
                     kept_fp32={"matmul": "table 'fp32' fastest as a whole step"})
    lever = _lever(facts)
    assert "PrecisionPolicy(rules={'matmul'" not in lever
    assert "kept in fp32 by the precision policy" in lever
    assert faster.phrase() in lever
    # the reason first: faster alone, the whole step measured otherwise
    assert "(table 'fp32' fastest as a whole step; alone, bf16 measured 2.00x faster" in lever


def test_a_float8_lever_only_from_autos_measurement_and_only_for_matmul():
    timed = SpeedFact("matmul", "fp8", 0.7, "6 Linears' GEMMs at this run's rows", "PrecisionPolicy(rules='auto') at"
                      " step 0", baseline="bf16", passes="forward and backward")
    chosen = SpeedFact("matmul", "fp8", 0.6, "4 Linears' GEMMs at this run's rows", timed.source, baseline="bf16",
                       passes="forward and backward")
    fact = Fp8Fact(timed, ("blocks.0.mlp.0", "blocks.0.mlp.2", "blocks.1.mlp.0", "blocks.1.mlp.2"), 6, chosen)
    assert "float8" not in _lever(RunFacts())
    lever = _lever(RunFacts(fp8=fact))
    assert f"float8 runs 4 of 6 timed Linears ({chosen.phrase()})" in lever
    assert "fp8 measured 1.67x faster than bf16 (forward and backward) at 4 Linears' GEMMs" in lever
    slower = Fp8Fact(SpeedFact("matmul", "fp8", 40.1, "15 Linears' GEMMs at this run's rows", timed.source,
                               baseline="bf16"), (), 15)
    assert f"{slower.speed.phrase()}: no float8 lever here" in _lever(RunFacts(fp8=slower))
    rows, peaks = _compute_bound_matmul()
    conv = ClassRoofline("conv", {"fp32": 1e12}, bytes=1e9, seconds=2.0, calls=10)
    assert "float8" not in lever_of(conv, RooflineReport({"conv": conv}, peaks, steps=1, step_seconds=2.0,
                                                        facts=RunFacts(fp8=fact)))


def test_a_float8_gemm_counts_its_flops_in_fp8():
    # torch's profiler counts no FLOPs for _scaled_mm: forward, grad input and grad weight are each 2 M K N
    from lightning_opkit.precision.fp8 import Float8Linears
    from lightning_opkit.profiler.op_times import window_events
    from lightning_opkit.profiler.roofline.work import _op_work

    m, k, n = 64, 32, 48
    linear = nn.Linear(k, n, bias=False)
    fp8 = Float8Linears("tensorwise", census=lambda: None)
    fp8.convert([("linear", linear)], torch.device("cpu"))
    x = torch.randn(m, k, requires_grad=True)
    prof = _profile(lambda: linear(x).sum().backward())
    fp8.restore()
    events = [e for e in window_events(prof) if e.key == "aten::_scaled_mm"]
    assert len(events) == 3
    work = [_op_work(e.key, "matmul", e) for e in events]
    assert [w[0] for w in work] == [2.0 * m * k * n] * 3
    assert {w[2] for w in work} == {"fp8"}


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


def test_fusion_lever_for_memory_bound_norm_and_activation_names_the_blocks():
    ln = nn.Sequential(nn.LayerNorm(1024), nn.GELU(), nn.LayerNorm(1024), nn.GELU())
    y = torch.randn(4096, 1024, requires_grad=True)
    rows = class_rooflines(_profile(lambda: ln(y).sum().backward()))
    peaks = checked_peaks(measure_peaks("cpu", ("fp32",)), achieved_rates(rows), "cpu")  # as a window's report
    report = RooflineReport(rows, peaks, steps=1, step_seconds=1.0, blocks=["model.blocks.0", "model.blocks.1"])
    assert rows["norm"].bound(peaks)[0] == "memory"
    lever = lever_of(rows["norm"], report)
    assert "TorchCompile(modules=['model.blocks.*'])" in lever
    assert f"({peaks.bandwidth_gbps:.1f} GB/s)" in lever  # the measured roof beside the percentage


def test_tiny_ops_are_overhead_bound_and_told_to_batch_or_compile():
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)

    def step():
        h = x
        for _ in range(50):
            h = lin(h)
        h.sum().backward()

    rows = class_rooflines(_profile(step))
    peaks = measure_peaks("cpu", ("fp32",))
    kind, pct = rows["matmul"].bound(peaks)
    assert kind == "overhead", pct
    lever = lever_of(rows["matmul"], RooflineReport(rows, peaks, steps=1, step_seconds=1.0))
    assert "calls / step" in lever
    assert "TorchCompile()" in lever
    assert "a bigger batch" in lever
    assert "CUDA graphs" not in lever  # not on a CPU


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


def test_gathers_count_the_rows_they_read_not_the_whole_table():
    table, ids = nn.Embedding(50_000, 64), torch.randint(0, 50_000, (32,))
    logits, target = torch.randn(32, 50_000), torch.randint(0, 50_000, (32,))
    logits.requires_grad_(True)
    with torch.profiler.profile(record_shapes=True, with_flops=True) as prof:
        table(ids)
        torch.nn.functional.nll_loss(logits, target).backward()
    rows = class_rooflines(prof)
    # 32 rows of 64 fp32 read and written, and the int64 indices: not the 12.8 MB table
    assert rows["embedding"].bytes == 2 * 32 * 64 * 4 + 32 * 8
    # forward and backward each touch one logit per target (the backward's zero fill is an op of its own)
    assert rows["loss"].bytes == 2 * (2 * 32 * 4 + 32 * 8)
    assert rows["embedding"].pct_bandwidth(measure_peaks("cpu", ("fp32",))) < 100


def test_attention_by_its_math_path_counts_its_gemms_as_matmul_and_is_told_so():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = k = v = torch.randn(2, 4, 64, 32)
    with sdpa_kernel(SDPBackend.MATH), torch.profiler.profile(record_shapes=True, with_flops=True) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    rows = class_rooflines(prof)
    peaks = measure_peaks("cpu", ("fp32",))
    assert rows["matmul"].flops == counter.get_total_flops() > 0  # the math path's two bmm, counted once
    assert rows["attention"].flops == 0
    assert rows["attention"].bound(peaks)[0] == "dispatch"
    report = RooflineReport(rows, peaks, steps=1, step_seconds=1.0)
    assert "no op of this class did work of its own" in lever_of(rows["attention"], report)
    assert report.worst().op_class != "attention"


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


def test_no_fusion_lever_where_torch_compile_compiled_and_eager_regions_named():
    ln = nn.Sequential(nn.LayerNorm(1024), nn.GELU(), nn.LayerNorm(1024), nn.GELU())
    y = torch.randn(4096, 1024, requires_grad=True)
    rows = class_rooflines(_profile(lambda: ln(y).sum().backward()))
    peaks = checked_peaks(measure_peaks("cpu", ("fp32",)), achieved_rates(rows), "cpu")  # as a window's report
    assert rows["norm"].bound(peaks)[0] == "memory"
    facts = RunFacts(compiled=["model.blocks.0", "model.blocks.1"], eager_regions={"model.blocks.1": 0.8})
    report = RooflineReport(rows, peaks, steps=1, step_seconds=1.0, blocks=["model.blocks.0", "model.blocks.1"],
                            facts=facts)
    lever = lever_of(rows["norm"], report)
    assert "TorchCompile(modules=" not in lever  # compiled already: fusion is not the lever
    assert "compiled already" in lever
    assert "model.blocks.1 (0.80x)" in lever  # the region measured slower compiled, and running eager, is named


# ---- memory layout, measured: channels_last against contiguous at the model's own convolutions


def _conv_lever(ratio, current):
    rows, peaks = _compute_bound_matmul()
    rows = {"conv": ClassRoofline("conv", {"fp32": 1e12}, bytes=1e9, seconds=2.0, calls=10)}
    fact = SpeedFact("conv", "channels_last", ratio, "this model's 2 costliest conv shapes", "measured by the roofline",
                     baseline="contiguous", current=current, passes="forward and backward")
    report = RooflineReport(rows, peaks, steps=1, step_seconds=2.0, facts=RunFacts(layouts={"conv": fact}))
    return fact, lever_of(rows["conv"], report)


def test_layout_lever_only_where_the_measurement_supports_it():
    fact, lever = _conv_lever(0.5, "contiguous")
    assert f"{fact.phrase()}: model.to(memory_format=torch.channels_last) before fit" in lever
    fact, lever = _conv_lever(1.02, "contiguous")  # inside the 5% bar: no switch for noise
    assert f"{fact.phrase()}: no layout lever here" in lever
    assert "memory_format" not in lever
    fact, lever = _conv_lever(1.5, "channels_last")  # a model in the slower layout is told to go back
    assert f"runs channels_last, but {fact.phrase()}: model.to(memory_format=torch.contiguous_format)" in lever
    fact, lever = _conv_lever(0.5, "channels_last")
    assert f"runs channels_last ({fact.phrase()})" in lever
    assert "memory_format" not in lever
    rows, peaks = _compute_bound_matmul()  # not timed: nothing said about layout
    assert "channels_last" not in lever_of(rows["matmul"],
                                           RooflineReport(rows, peaks, steps=1, step_seconds=2.0, facts=RunFacts()))


def test_both_layouts_timed_compute_the_same_gradients():
    # the comparison is fair only if the two runs do the same work: the same convolution, in two layouts
    arguments = [[2, 2], [1, 1], [1, 1], False, [0, 0], 2]
    torch.manual_seed(0)
    contiguous = _step([[4, 8, 16, 16], [16, 4, 3, 3], [16]], arguments, torch.float32, torch.device("cpu"), False)
    torch.manual_seed(0)
    channels_last = _step([[4, 8, 16, 16], [16, 4, 3, 3], [16]], arguments, torch.float32, torch.device("cpu"), True)
    for a, b in zip(contiguous(), channels_last(), strict=True):
        torch.testing.assert_close(a, b)
    assert channels_last()[0].is_contiguous(memory_format=torch.channels_last)
    assert not contiguous()[0].is_contiguous(memory_format=torch.channels_last)


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


def test_mfu_is_said_only_against_dtypes_that_ran_and_an_impossible_share_is_called_a_fault():
    from lightning_opkit.profiler.roofline.view import mfu_line

    # fp32 ran; bf16's peak is tiny (emulated on a CPU without bf16 units), as on the AVX2 EPYC: 957% against it
    rows = {"matmul": ClassRoofline("matmul", {"fp32": 1e12}, bytes=1e9, seconds=2.0, calls=10)}
    report = RooflineReport(rows, Peaks("cpu", {"fp32": 10.0, "bf16": 0.001}, 100.0), steps=1, step_seconds=2.0)
    line = mfu_line(report)
    assert line.startswith("MFU 5.0% of the measured peak of the dtypes that ran")
    assert "bf16" not in line
    # both ran: each is a reference; an fp32 peak measured far too low gives an impossible share, named as a fault
    rows = {"matmul": ClassRoofline("matmul", {"fp32": 1e12, "bf16": 1e12}, bytes=1e9, seconds=2.0, calls=10)}
    report = RooflineReport(rows, Peaks("cpu", {"fp32": 0.1, "bf16": 10.0}, 100.0), steps=1, step_seconds=2.0)
    line = mfu_line(report)
    assert "against fp32 1000% (impossible: above 100% the measured peak is too low, a measurement fault)" in line
    assert "bf16 10.0%" in line


def test_a_peak_measured_on_a_busy_machine_is_measured_again_before_a_verdict_rests_on_it():
    """A fp32 peak a thousand times too low (as if taken while other work held the cores) judged LayerNorm
    compute-bound; checked against what the window's classes reached, it is measured again and the verdict is the
    bytes' one. A rate no measurement reaches leaves the peak named as disturbed."""
    ln = nn.Sequential(nn.LayerNorm(1024), nn.GELU(), nn.LayerNorm(1024), nn.GELU())
    y = torch.randn(4096, 1024, requires_grad=True)
    rows = class_rooflines(_profile(lambda: ln(y).sum().backward()))
    busy = Peaks("cpu", {"fp32": 1e-6}, measure_peaks("cpu", ("fp32",)).bandwidth_gbps, {"fp32": 256})
    assert rows["norm"].bound(busy)[0] == "compute"  # the wrong verdict a disturbed peak gives
    checked = checked_peaks(busy, achieved_rates(rows), "cpu")
    assert checked.gemm_tflops["fp32"] > 1e-3
    assert checked.disturbed == {}
    assert rows["norm"].bound(checked)[0] == "memory"
    impossible = checked_peaks(busy, {"fp32": 1e6}, "cpu", tries=1)
    assert "fp32" in impossible.disturbed
    assert "fp32's peak looks disturbed (an op class ran at 1e+06 TFLOP/s, above it)" in impossible.describe()
