"""How the roofline is shown (profiler/roofline/view.py): MFU only against the dtypes that ran, an impossible share
called a fault."""


from lightning_opkit.profiler.roofline.peaks import Peaks
from lightning_opkit.profiler.roofline.report import RooflineReport
from lightning_opkit.profiler.roofline.work import ClassRoofline


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
