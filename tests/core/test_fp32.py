"""One module run in fp32 (core/fp32.py): its ops see fp32, autocast is off inside and back after, its output handed
on in the 16-bit dtype it met, and nothing stays behind."""

import torch
from torch import nn

from lightning_opkit.core.fp32 import autocast_off, has_low_weights, in_fp32


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
