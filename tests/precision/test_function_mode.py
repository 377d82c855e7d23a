"""The policy's TorchFunctionMode (precision/function_mode.py), Trainer-free: each op in its class's dtype, a module
override's dtype above it, autocast off where the mode decides, random ops never cast, the census on census steps;
each dtype read from the op's output by a hook of this test's own."""

import torch
import torch.nn.functional as F
from torch import nn

from lightning_opkit.core.suspend import SUSPENDED
from lightning_opkit.precision.census import Census
from lightning_opkit.precision.function_mode import ModeState, PolicyMode, match_weight_dtype


def _table(**dtypes):
    return {"matmul": "fp32", "norm": "fp32", "activation": "fp32", "pointwise": "keep", "reduction": "keep",
            "loss": "keep", "softmax": "keep", **dtypes}


def test_each_op_runs_in_its_class_s_dtype_and_keep_leaves_it_alone():
    net = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))
    seen = {}
    for name, module in net.named_children():
        module.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.dtype))
    with PolicyMode(ModeState(_table(matmul="bf16", activation="bf16"))):
        out = net(torch.randn(4, 8))
        kept = out * 2  # pointwise: keep
    assert seen == {"0": torch.bfloat16, "1": torch.bfloat16, "2": torch.float32}
    assert kept.dtype == torch.float32


def test_a_module_override_on_the_stack_decides_every_op_inside():
    state = ModeState(_table(matmul="bf16"))
    with PolicyMode(state):
        state.module_stack.append(torch.float32)  # what an override's pre-hook pushes
        inside = F.linear(torch.randn(2, 4), torch.randn(3, 4))
        state.module_stack.pop()
        outside = F.linear(torch.randn(2, 4), torch.randn(3, 4))
    assert (inside.dtype, outside.dtype) == (torch.float32, torch.bfloat16)


def test_under_autocast_the_policy_decides_and_autocast_stays_on_around_it():
    state = ModeState(_table(matmul="fp32"))
    state.autocast_devices = ["cpu"]
    with torch.autocast("cpu", dtype=torch.bfloat16), PolicyMode(state):
        gemm = F.linear(torch.randn(2, 4), torch.randn(3, 4))  # the policy says fp32: autocast does not recast it
        assert torch.is_autocast_enabled("cpu")
        with torch.autocast("cpu", enabled=False):  # the user turned autocast off here: their code as written
            plain = F.linear(torch.randn(2, 4).bfloat16(), torch.randn(3, 4).bfloat16())
    assert gemm.dtype == torch.float32
    assert plain.dtype == torch.bfloat16


def test_random_ops_are_never_cast_so_their_mask_is_fp32_s():
    x = torch.randn(1000)
    torch.manual_seed(0)
    expected = F.dropout(x, 0.5)
    torch.manual_seed(0)
    with PolicyMode(ModeState(_table(activation="bf16", pointwise="bf16"))):
        got = F.dropout(x, 0.5)
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)


def test_suspended_the_mode_passes_every_call_through():
    with PolicyMode(ModeState(_table(matmul="bf16"))), SUSPENDED.scope():
        assert F.linear(torch.randn(2, 4), torch.randn(3, 4)).dtype == torch.float32


def test_a_census_step_counts_each_class_and_dtype():
    state = ModeState(_table(matmul="bf16"))
    state.census = Census()
    with PolicyMode(state):
        F.linear(torch.randn(2, 4), torch.randn(3, 4))
        F.linear(torch.randn(2, 4), torch.randn(3, 4))
    rows = {(r.op_class, r.dtype): r for r in state.census.rows()}
    assert rows[("matmul", "bf16")].calls == 2
    assert rows[("matmul", "bf16")].rel_error is not None  # against an fp32 recompute of the same op


def test_an_rnn_s_input_meets_its_weights_dtype():
    lstm = nn.LSTM(4, 4)
    cast = match_weight_dtype(lstm, (torch.ones(2, 1, 4, dtype=torch.bfloat16),))
    assert cast[0].dtype == torch.float32
    assert match_weight_dtype(lstm, (torch.ones(2, 1, 4),)) is None
