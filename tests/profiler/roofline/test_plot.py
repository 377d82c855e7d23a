"""The roofline picture (profiler/roofline/plot.py): a matplotlib figure with one point per op class that did work,
its roofs at the measured peaks."""

import matplotlib

from lightning_opkit.profiler.roofline.peaks import Peaks
from lightning_opkit.profiler.roofline.plot import roofline_figure
from lightning_opkit.profiler.roofline.work import ClassRoofline

matplotlib.use("Agg")


def test_one_labelled_point_per_class_with_work_and_the_roofs_at_the_peaks():
    rows = {"matmul": ClassRoofline("matmul", {"fp32": 1e12}, bytes=1e9, seconds=2.0, calls=10),
            "norm": ClassRoofline("norm", {"fp32": 1e9}, bytes=4e9, seconds=1.0, calls=10),
            "copy": ClassRoofline("copy", {}, bytes=1e9, seconds=0.1, calls=3)}
    figure = roofline_figure(rows, Peaks("cpu", {"fp32": 2.0}, 50.0), "window 1 on cpu")
    (axes,) = figure.axes
    assert axes.get_title(loc="left") == "window 1 on cpu"
    assert sorted(t.get_text() for t in axes.texts) == ["matmul", "norm"]  # copy did no FLOPs: no point for it
    legend = [t.get_text() for t in axes.get_legend().get_texts()]
    assert legend[:2] == ["fp32 GEMM 2 TFLOP/s", "copy 50.0 GB/s"]  # the roofs at the measured peaks
    assert "matmul (fp32) 0.5 TFLOP/s" in legend  # 1e12 FLOPs in 2 s
    assert axes.get_xscale() == axes.get_yscale() == "log"


def test_a_window_with_nothing_to_place_says_so():
    rows = {"copy": ClassRoofline("copy", {}, bytes=1e9, seconds=0.1, calls=3)}
    (axes,) = roofline_figure(rows, Peaks("cpu", {"fp32": 2.0}, 50.0), "window 2").axes
    assert [t.get_text() for t in axes.texts] == ["no op with both FLOPs and bytes recorded in this window"]
