"""What to do about an op class (profiler/roofline/levers.py): only what a measurement supports, each lever naming
the measurement it rests on. Trainer-free: rows from real profiles or built by hand, facts built by hand."""

import torch
from helpers import profiled
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_opkit.core.facts import Fp8Fact, RunFacts, SpeedFact
from lightning_opkit.profiler.roofline.levers import lever as lever_of
from lightning_opkit.profiler.roofline.peaks import Peaks, checked_peaks, measure_peaks
from lightning_opkit.profiler.roofline.report import RooflineReport
from lightning_opkit.profiler.roofline.work import ClassRoofline, achieved_rates, class_rooflines


def _compute_bound_matmul():
    # 1 TFLOP in 2 s against a 1 TFLOP/s fp32 roof: compute-bound at 50%
    peaks = Peaks("cpu", {"fp32": 1.0, "bf16": 4.0}, 100.0)
    return {"matmul": ClassRoofline("matmul", {"fp32": 1e12}, bytes=1e9, seconds=2.0, calls=10)}, peaks


def _lever(facts):
    rows, peaks = _compute_bound_matmul()
    assert rows["matmul"].bound(peaks)[0] == "compute"
    return lever_of(rows["matmul"], RooflineReport(rows, peaks, steps=1, step_seconds=2.0, facts=facts))


def _conv_lever(ratio, current):
    rows, peaks = _compute_bound_matmul()
    rows = {"conv": ClassRoofline("conv", {"fp32": 1e12}, bytes=1e9, seconds=2.0, calls=10)}
    fact = SpeedFact("conv", "channels_last", ratio, "this model's 2 costliest conv shapes", "measured by the roofline",
                     baseline="contiguous", current=current, passes="forward and backward")
    report = RooflineReport(rows, peaks, steps=1, step_seconds=2.0, facts=RunFacts(layouts={"conv": fact}))
    return fact, lever_of(rows["conv"], report)


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


def test_fusion_lever_for_memory_bound_norm_and_activation_names_the_blocks():
    ln = nn.Sequential(nn.LayerNorm(1024), nn.GELU(), nn.LayerNorm(1024), nn.GELU())
    y = torch.randn(4096, 1024, requires_grad=True)
    rows = class_rooflines(profiled(lambda: ln(y).sum().backward()))
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

    rows = class_rooflines(profiled(step))
    peaks = measure_peaks("cpu", ("fp32",))
    kind, pct = rows["matmul"].bound(peaks)
    assert kind == "overhead", pct
    lever = lever_of(rows["matmul"], RooflineReport(rows, peaks, steps=1, step_seconds=1.0))
    assert "calls / step" in lever
    assert "TorchCompile()" in lever
    assert "a bigger batch" in lever
    assert "CUDA graphs" not in lever  # not on a CPU


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


def test_no_fusion_lever_where_torch_compile_compiled_and_eager_regions_named():
    ln = nn.Sequential(nn.LayerNorm(1024), nn.GELU(), nn.LayerNorm(1024), nn.GELU())
    y = torch.randn(4096, 1024, requires_grad=True)
    rows = class_rooflines(profiled(lambda: ln(y).sum().backward()))
    peaks = checked_peaks(measure_peaks("cpu", ("fp32",)), achieved_rates(rows), "cpu")  # as a window's report
    assert rows["norm"].bound(peaks)[0] == "memory"
    facts = RunFacts(compiled=["model.blocks.0", "model.blocks.1"], eager_regions={"model.blocks.1": 0.8})
    report = RooflineReport(rows, peaks, steps=1, step_seconds=1.0, blocks=["model.blocks.0", "model.blocks.1"],
                            facts=facts)
    lever = lever_of(rows["norm"], report)
    assert "TorchCompile(modules=" not in lever  # compiled already: fusion is not the lever
    assert "compiled already" in lever
    assert "model.blocks.1 (0.80x)" in lever  # the region measured slower compiled, and running eager, is named


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
