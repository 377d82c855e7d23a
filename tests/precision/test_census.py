"""The census (precision/census.py): each row's calls, peak, error, underflow and fp16 headroom, checked against the
same figures computed directly by this test; one host read for all rows."""

import math

import torch
import torch.nn.functional as F

from lightning_opkit.precision.census import Census, census_markdown, fp32_reference, near_overflow


def test_error_underflow_and_peak_accumulate_over_calls_as_computed_directly():
    torch.manual_seed(0)
    refs = [torch.randn(64) * 1e-3, torch.randn(32) * 10]
    outs = [r.half() for r in refs]
    census = Census()
    for out, ref in zip(outs, refs):
        census.record("pointwise", out, False, ref=ref)
    (row,) = census.rows()
    err = sum((o.float() - r).square().sum() for o, r in zip(outs, refs))
    ref2 = sum(r.square().sum() for r in refs)
    under = sum(((r != 0) & (o.float().abs() < torch.finfo(torch.half).tiny)).sum() for o, r in zip(outs, refs))
    assert (row.op_class, row.dtype, row.override, row.calls) == ("pointwise", "fp16", False, 2)
    assert math.isclose(row.rel_error, math.sqrt(err / ref2), rel_tol=1e-5)
    assert math.isclose(row.underflow_frac, float(under) / 96, rel_tol=1e-6)
    assert row.absmax == max(float(o.float().abs().max()) for o in outs)
    assert math.isclose(row.headroom_bits, math.log2(65504 / row.absmax), rel_tol=1e-6)


def test_rows_are_kept_apart_by_class_dtype_and_override_riskiest_first():
    census = Census()
    x = torch.linspace(1, 2, 16)
    census.record("matmul", x.bfloat16(), False, ref=x)
    census.record("matmul", x.bfloat16(), True, ref=x * 1.5)  # an override's row, far off
    census.record("norm", x, False)  # fp32: counted, no error figure
    rows = census.rows()
    assert [(r.op_class, r.override) for r in rows] == [("matmul", True), ("matmul", False), ("norm", False)]
    assert rows[0].rel_error > rows[1].rel_error
    assert rows[2].rel_error is None
    assert rows[2].headroom_bits is None  # fp32 has no fp16 headroom to tell
    text = census_markdown(rows, {"matmul": "bf16", "norm": "fp32"})
    assert text.count("| matmul |") == 2


def test_near_overflow_picks_fp16_rows_close_to_its_largest_value():
    census = Census()
    census.record("matmul", torch.tensor([60000.0]).half(), False)
    census.record("norm", torch.tensor([1.0]).half(), False)
    assert [r.op_class for r in near_overflow(census.rows())] == ["matmul"]


def test_the_fp32_reference_reruns_the_op_on_the_uncast_inputs_and_draws_the_same_random_numbers():
    x = torch.randn(1000)
    rng = (torch.get_rng_state(), None)
    dropped = F.dropout(x.bfloat16(), p=0.5, training=True)
    after = torch.get_rng_state()
    ref = fp32_reference(F.dropout, (x,), {"p": 0.5, "training": True}, rng)
    assert ref.dtype == torch.float32
    assert torch.equal(ref == 0, dropped == 0)  # the same mask
    assert torch.equal(torch.get_rng_state(), after)  # the run's random stream goes on where the op left it
    inplace = x.clone()
    fp32_reference(F.relu, (inplace,), {"inplace": True}, rng)
    assert torch.equal(inplace, x)  # never in place on the caller's tensor
