"""A window's times per op class (profiler/op_times.py), Trainer-free, from a real torch.profiler run: each class's
self time is the sum of its ops' self time as the profiler's own key_averages() gives it; FLOPs as FlopCounterMode
counts them; a region's span and the settling barrier handled as documented."""

import time

import pytest
import torch
from helpers import flop_counter
from torch import nn

from lightning_opkit.opclass import classify_profiler_event, is_framework_event
from lightning_opkit.profiler.op_times import summarize, window_events
from lightning_opkit.profiler.session import SETTLE


def _step(model, x):
    return lambda: model(x).sum().backward()


def _profile(step, settle=False):
    step()
    with torch.profiler.profile(record_shapes=True, with_flops=True) as prof:
        with torch.profiler.record_function("opkit region model.mlp"):
            step()
        if settle:
            with torch.profiler.record_function(SETTLE):
                torch.ones(512, 512) @ torch.ones(512, 512)  # no part of the step
    return prof


def test_class_times_are_the_profiler_s_own_self_times_by_class_and_flops_flop_counter_s():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64)), torch.randn(32, 64)
    prof = _profile(_step(model, x))
    report = summarize(prof, [0.01, 0.03], use_device=False)
    by_class: dict[str, float] = {}
    for e in prof.key_averages():
        if not is_framework_event(e.key):
            cls = classify_profiler_event(e.key)
            by_class[cls] = by_class.get(cls, 0.0) + e.self_cpu_time_total
    assert {c: t for c, t in report.class_self_us.items() if t} == pytest.approx(by_class)
    assert sum(report.class_percent().values()) == pytest.approx(100.0)
    assert report.steps == 2
    assert report.step_time_ms == pytest.approx(20.0)
    assert report.ops == sorted(report.ops, key=lambda r: -r.self_us)
    with flop_counter() as counter:
        _step(model, x)()
    assert report.flops == counter.get_total_flops()
    assert set(report.region_total_us) == {"model.mlp"}
    assert report.region_total_us["model.mlp"] > 0
    assert report.communication_us == 0.0


def test_what_began_once_the_window_was_settling_is_no_part_of_it():
    model, x = nn.Linear(64, 64), torch.randn(8, 64)
    settled = _profile(_step(model, x), settle=True)
    names = [e.name for e in window_events(settled)]
    assert SETTLE not in names
    assert len(names) < len(settled.events())
    with flop_counter() as counter:
        _step(model, x)()
    # the step's FLOPs alone: the 512 x 512 product after the barrier began is not counted
    assert summarize(settled, [0.01], use_device=False).flops == counter.get_total_flops()


def test_a_recompile_inside_the_window_is_no_work_of_its_steps():
    """The demo's third window recompiled a region: dynamo traced its ops on fake tensors under the profiler, and the
    roofline met an addmm with a missing operand shape. The window's GEMMs are now the steps' own: none traced, none
    under one of torch's ``dynamo_timed`` spans, and the roofline's GEMM FLOPs those of a window of the same step
    that compiled nothing."""
    from lightning_opkit.profiler.roofline.work import class_rooflines

    torch.manual_seed(0)
    mlp = torch.compile(nn.Sequential(nn.Linear(64, 192), nn.GELU(), nn.Linear(192, 64)), backend="inductor")
    small, large = torch.randn(8, 64, requires_grad=True), torch.randn(24, 64, requires_grad=True)
    mlp(small).sum().backward()

    def window(x):
        with torch.profiler.profile(record_shapes=True, with_flops=True) as prof:
            mlp(x).sum().backward()
        return prof

    def traced(events):  # a GEMM with an operand the trace holds no shape of: run on a fake tensor
        return [e for e in events if e.name in ("aten::addmm", "aten::mm") and
                sum(len(shape) >= 2 for shape in e.input_shapes) < 2]

    def under_a_compile_span(e):
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.endswith("(dynamo_timed)"):
                return True
            parent = parent.cpu_parent
        return False

    torch._dynamo.mark_static(large, 0)
    recompiling = window(large)  # a new static size: dynamo and Inductor compile again, inside the window
    warm = window(large)  # the same step, compiled already
    compiling = [e for e in recompiling.events() if e.name in ("aten::addmm", "aten::mm") and under_a_compile_span(e)]
    assert compiling, "the window compiled: dynamo traced the region's GEMMs under the profiler"
    kept = window_events(recompiling)
    assert not traced(kept)
    assert not [e.name for e in kept if under_a_compile_span(e)]
    assert class_rooflines(recompiling)["matmul"].flops == class_rooflines(warm)["matmul"].flops > 0


def test_a_recompile_inside_the_window_leaves_its_step_time_too():
    """What the recompile cost is no step's work: the window's step time is the steps' less the outermost compile
    spans, and the report says how much it left out. A window that compiled nothing leaves out nothing."""
    from lightning_opkit.profiler.op_times import compiling_seconds

    torch.manual_seed(0)
    mlp = torch.compile(nn.Sequential(nn.Linear(64, 192), nn.GELU(), nn.Linear(192, 64)), backend="aot_eager")
    mlp(torch.randn(8, 64, requires_grad=True)).sum().backward()
    large = torch.randn(24, 64, requires_grad=True)
    torch._dynamo.mark_static(large, 0)

    def window():
        began = time.perf_counter()
        with torch.profiler.profile(record_shapes=True) as prof:
            mlp(large).sum().backward()
        return prof, time.perf_counter() - began

    (recompiling, wall), (warm, warm_wall) = window(), window()
    # torch's own span of the recompile: entire_frame_compile, or on torch 2.9 _compile.compile_inner
    spans = [e for e in recompiling.events() if e.name.startswith(("entire_frame_compile", "_compile.compile_inner"))]
    assert spans
    compiling = compiling_seconds(recompiling)
    assert compiling >= max(e.cpu_time_total for e in spans) / 1e6 > 0  # at least the frame's compile
    assert compiling < wall
    report = summarize(recompiling, [wall], use_device=False)
    assert report.compiling_ms == pytest.approx(1e3 * compiling)
    assert report.step_time_ms == pytest.approx(1e3 * (wall - compiling))
    assert compiling_seconds(warm) == 0.0
    assert summarize(warm, [warm_wall], use_device=False).step_time_ms == pytest.approx(1e3 * warm_wall)
