"""Dtype names as opkit prints them (core/dtypes.py), and the profiler's C++ names mapped to them."""

import torch
from torch import nn

from lightning_opkit.core.dtypes import (
    BY_NAME,
    PROFILER_DTYPES,
    autocast_off,
    cast,
    full_name,
    has_low_weights,
    in_fp32,
    short_name,
)
from lightning_opkit.core.torch_compat import events_with_dtypes


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
    # through the compat module: before torch 2.13 the dtypes are on the kineto events only
    recorded = {d for e in events_with_dtypes(prof) if e.name == "aten::mm" for d in e.input_dtypes if d}
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


# One module run in fp32 (core/dtypes.py): its ops see fp32, autocast is off inside and back after, its output handed
# on in the 16-bit dtype it met, and nothing stays behind.


def test_a_16_bit_module_computes_in_fp32_and_hands_on_its_inputs_dtype():
    layer = nn.Linear(4, 4).half()
    x = torch.ones(2, 4, dtype=torch.half)
    seen: list[torch.dtype] = []
    handle = layer.register_forward_hook(lambda m, args, out: seen.append(out.dtype))  # the caller's, registered first
    with in_fp32(layer, weights=True):
        assert layer(x).dtype == torch.float16  # handed on in the dtype it met
    assert seen == [torch.float32]  # what it computed
    handle.remove()
    assert layer.weight.dtype == torch.float16  # the weights themselves are not converted
    assert layer(x).dtype == torch.float16
    assert not layer._forward_hooks
    assert not layer._forward_pre_hooks


def test_the_fp32_result_is_the_fp32_computation():
    torch.manual_seed(0)
    layer = nn.Linear(16, 16)
    x = torch.randn(4, 16)
    expected = layer(x)
    low = nn.Linear(16, 16).to(torch.bfloat16)
    low.load_state_dict(layer.state_dict())
    with in_fp32(low, weights=True, cast_back=False):
        got = low(x.to(torch.bfloat16))
    # the weights went through bf16 once (stored there), the GEMM ran in fp32: close to fp32, not to a bf16 GEMM
    reference = nn.functional.linear(x.bfloat16().float(), low.weight.float(), low.bias.float())
    assert got.dtype == torch.float32
    assert torch.allclose(got, reference, atol=1e-6)
    assert torch.allclose(got, expected, atol=0.1)


def test_autocast_is_off_inside_the_module_and_on_again_after():
    layer = nn.Linear(4, 4)
    inside = []
    layer.register_forward_pre_hook(lambda m, args: inside.append(torch.is_autocast_enabled("cpu")))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with in_fp32(layer, weights=False):
            assert layer(torch.ones(2, 4)).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")
        assert layer(torch.ones(2, 4)).dtype == torch.bfloat16
    assert inside == [False, True]
    with torch.autocast("cpu"), autocast_off():
        assert not torch.is_autocast_enabled("cpu")


def test_low_weights_are_16_bit_floating_parameters():
    assert not has_low_weights(nn.Linear(2, 2))
    assert has_low_weights(nn.Linear(2, 2).to(torch.bfloat16))
    assert not has_low_weights(nn.ReLU())
