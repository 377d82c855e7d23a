"""Dtype names as opkit prints them (core/dtypes.py), and the profiler's C++ names mapped to them."""

import torch

from lightning_opkit.core.dtypes import BY_NAME, PROFILER_DTYPES, cast, full_name, short_name


def test_short_names_round_trip_and_every_float8_is_fp8():
    for name, dtype in BY_NAME.items():
        assert short_name(dtype) == name
    assert short_name(torch.float8_e4m3fn) == short_name(torch.float8_e5m2) == "fp8"
    assert short_name(torch.int32) == "int32"  # anything else by torch's own name
    assert full_name(torch.bfloat16) == "bfloat16"


def test_the_profiler_s_names_are_the_ones_a_real_profile_records():
    x = torch.ones(4, 4, dtype=torch.bfloat16)
    with torch.profiler.profile(record_shapes=True) as prof:
        torch.mm(x, x)
        torch.mm(x.float(), x.float())
    recorded = {d for e in prof.events() if e.name == "aten::mm" for d in e.input_dtypes if d}
    assert recorded <= set(PROFILER_DTYPES)
    assert {PROFILER_DTYPES[d] for d in recorded} == {"bf16", "fp32"}


def test_cast_touches_floating_tensors_only_and_keeps_the_container():
    ints = torch.arange(3)
    out = cast((torch.ones(2), ints), torch.float16)
    assert isinstance(out, tuple)
    assert out[0].dtype == torch.float16
    assert out[1] is ints
    same = torch.ones(2, dtype=torch.float16)
    assert cast(same, torch.float16) is same  # no copy when it is already there
    assert cast("text", torch.float16) == "text"
