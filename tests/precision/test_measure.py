"""measure_precision (precision/measure.py), Trainer-free, against an independent computation: the same MLP with its
GEMMs written out in bf16 by hand gives the loss change and gradient cosine the measurement reports; and the model is
as before afterwards."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_opkit.precision.measure import measure_precision


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _by_hand(model, x, low):
    """The loss and gradients with both GEMMs in ``low`` (inputs, weights and bias cast), the rest in fp32."""
    params = list(model.parameters())
    w1, b1, w2, b2 = params

    def gemm(inp, w, b):
        return F.linear(inp.to(low), w.to(low), b.to(low)).float() if low is not None else F.linear(inp, w, b)

    loss = gemm(gemm(x, w1, b1).relu(), w2, b2).square().mean()
    grads = torch.autograd.grad(loss, params)
    return loss.detach(), torch.cat([g.reshape(-1) for g in grads])


def test_the_error_of_bf16_gemms_is_what_the_same_computation_by_hand_gives():
    model = _mlp()
    x = torch.randn(8, 16)
    table = measure_precision(model, lambda: x, loss_fn=lambda m, b: m(b).square().mean(), classes=["matmul"],
                              dtypes=["bf16"], reps=1)
    row = table.get("matmul", "bf16")
    ref_loss, ref_grads = _by_hand(model, x, None)
    low_loss, low_grads = _by_hand(model, x, torch.bfloat16)
    assert row.loss_change == pytest.approx(abs(low_loss - ref_loss).item() / abs(ref_loss).item(), rel=1e-4)
    assert row.grad_cosine == pytest.approx(F.cosine_similarity(low_grads, ref_grads, dim=0).item(), abs=1e-6)
    assert row.loss_change > 0  # bf16 does change it: the comparison is not of two fp32 runs
    assert math.isclose(table.loss, ref_loss.item(), rel_tol=1e-6)
    assert row.calls == 2  # two GEMMs per forward
    assert row.time_ratio is not None
    assert row.time_ratio > 0
    assert table.classes == ["matmul"]


def test_the_model_its_gradients_and_the_rng_are_as_before():
    model = _mlp()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    measure_precision(model, lambda: torch.randn(8, 16, generator=torch.Generator().manual_seed(1)),
                      loss_fn=lambda m, b: m(b).sum(), reps=1)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_bad_arguments_are_refused_naming_the_valid_ones():
    model = _mlp()
    with pytest.raises(ValueError, match="`dtypes` may hold 'bf16' and 'fp16', but got 'fp8'"):
        measure_precision(model, lambda: torch.randn(2, 16), dtypes=["fp8"])
    with pytest.raises(ValueError, match=r"unknown op classes \['gemm'\]; valid classes are \['matmul'"):
        measure_precision(model, lambda: torch.randn(2, 16), classes=["gemm"])
    with pytest.raises(ValueError, match="could not find a scalar loss"):
        measure_precision(model, lambda: torch.randn(2, 16))  # the model returns logits, no loss_fn
