"""What a profiler window writes (profiler/log.py), Trainer-free: a WindowReport written through a real LogWriter and
read back with TensorBoard's EventAccumulator, per-step figures as the report's totals divided by its steps; a class is
charted from the first window it ran in on; the custom-scalar charts match the tags written."""

import re

import lightning.pytorch as pl
import pytest
from helpers import read_events

from lightning_opkit.core.logging import LogWriter
from lightning_opkit.profiler.log import log_window, window_charts
from lightning_opkit.profiler.op_times import OpRow, WindowReport


def _report(matmul_us, norm_us):
    ops = [OpRow("aten::addmm", "matmul", 8, matmul_us, matmul_us, 10**9), OpRow("aten::layer_norm", "norm", 4,
                                                                                  norm_us, norm_us, 0)]
    return WindowReport(steps=2, step_time_ms=5.0, ops=[o for o in ops if o.self_us],
                        class_self_us={"matmul": matmul_us, "norm": norm_us, "loss": 0.0},
                        framework_self_us=400.0, flops=10**9)


def test_two_windows_read_back_per_step_and_a_class_charted_from_its_first_run_on(tmp_path):
    writer, charted = LogWriter(pl.Trainer(logger=False, enable_progress_bar=False), log_dir=str(tmp_path)), set()
    log_window(writer, _report(6000.0, 0.0), 10, window_no=1, partial=False, export_s=0.25, with_flops=True,
               top_k=5, charted=charted)
    log_window(writer, _report(3000.0, 1000.0), 20, window_no=2, partial=True, export_s=None, with_flops=True,
               top_k=5, charted=charted)
    writer.close()
    scalars, texts = read_events(str(tmp_path))

    def read(tag):  # TensorBoard stores scalars as float32
        return {step: pytest.approx(value, rel=1e-6) for step, value in scalars[tag]}

    assert read("opkit/profiler/matmul/self_ms") == {10: 3.0, 20: 1.5}  # 6000 us over 2 steps, then 3000
    assert read("opkit/profiler/matmul/percent") == {10: 100.0, 20: 75.0}
    assert read("opkit/profiler/norm/self_ms") == {20: 0.5}  # not charted before it ran
    assert "opkit/profiler/loss/self_ms" not in scalars  # never ran: never charted
    assert read("opkit/profiler/framework_ms") == {10: 0.2, 20: 0.2}
    assert read("opkit/profiler/gflops_per_s") == {10: 100.0, 20: 100.0}  # 1 GFLOP in 2 steps of 5 ms
    assert read("opkit/profiler/export_s") == {10: 0.25}
    assert charted == {"matmul", "norm"}
    (_, top), (_, later) = texts["opkit/profiler/top_ops"]
    assert top.startswith("Window 1: steps 9-10 (2 step(s)); framework / Python overhead")
    assert later.startswith("Window 2: steps 19-20 (2 step(s), cut short)")
    assert "| aten::addmm | matmul | 4.000 |" in top


def test_every_tag_written_is_in_a_chart_of_the_layout(tmp_path):
    writer = LogWriter(pl.Trainer(logger=False, enable_progress_bar=False), log_dir=str(tmp_path))
    log_window(writer, _report(6000.0, 1000.0), 10, window_no=1, partial=False, export_s=None, with_flops=False,
               top_k=5, charted=set())
    writer.close()
    scalars, _ = read_events(str(tmp_path))
    patterns = [p for chart in window_charts(roofline=False)["opkit profiler"].values() for p in chart[1]]
    per_class = [tag for tag in scalars if re.fullmatch(r"opkit/profiler/[a-z]+/(percent|self_ms)", tag)]
    assert per_class
    for tag in [*per_class, "opkit/profiler/step_time_ms", "opkit/profiler/framework_ms"]:
        assert any(re.fullmatch(p, tag) for p in patterns), tag
    assert set(window_charts(roofline=True)) == {"opkit profiler", "opkit roofline"}
