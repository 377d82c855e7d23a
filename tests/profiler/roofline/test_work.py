"""Work per op class from real profiler runs (profiler/roofline/work.py): FLOPs equal to torch's own
FlopCounterMode's, bytes of what an op reads and writes. Trainer-free: a profiled forward and backward."""

import pytest
import torch
from helpers import flop_counter, profiled
from torch import nn
from zoo import build

from lightning_opkit.profiler.roofline.peaks import measure_peaks
from lightning_opkit.profiler.roofline.work import class_rooflines


def _counted_and_profiled(case):
    """FlopCounterMode's counts per op and the roofline's rows of one forward and backward of a zoo case."""
    model = build(case)
    batch = next(iter(model.loader()))

    def step():
        model.model.zero_grad()
        model.case.loss(model.model, batch).backward()

    with flop_counter() as counter:
        step()
    return {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}, class_rooflines(profiled(step))


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
    prof = profiled(lambda: linear(x).sum().backward())
    fp8.restore()
    events = [e for e in window_events(prof) if e.key == "aten::_scaled_mm"]
    assert len(events) == 3
    work = [_op_work(e.key, "matmul", e) for e in events]
    assert [w[0] for w in work] == [2.0 * m * k * n] * 3
    assert {w[2] for w in work} == {"fp8"}


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


def test_a_gemm_whose_operand_shape_the_trace_lacks_is_time_without_work_not_a_crash():
    """What the demo's roofline died of (IndexError): ``aten::addmm`` recorded as ``[[192], [], [64, 192]]``, its
    left operand's shape missing (traced on a fake tensor). torch's own event type, as the profiler hands it over."""
    from torch.autograd.profiler_util import FunctionEvent

    from lightning_opkit.profiler.roofline.work import UnrecordedShapes, _op_work

    # input_dtypes set as events_with_dtypes sets them: FunctionEvent takes them as an argument from torch 2.13 only
    event = FunctionEvent(0, "aten::addmm", thread=0, start_us=0, end_us=5, input_shapes=[[192], [], [64, 192], [], []])
    event.input_dtypes = ["float", "", "float", "Scalar", "Scalar"]
    with pytest.raises(UnrecordedShapes):
        _op_work("aten::addmm", "matmul", event)
    whole = FunctionEvent(0, "aten::addmm", thread=0, start_us=0, end_us=5,
                          input_shapes=[[192], [8, 64], [64, 192], [], []])
    whole.input_dtypes = ["float", "float", "float", "Scalar", "Scalar"]
    # its bytes: the three operands and the 8 x 192 output, 4 bytes each
    assert _op_work("aten::addmm", "matmul", whole)[1] == 4 * (192 + 8 * 64 + 64 * 192 + 8 * 192)
