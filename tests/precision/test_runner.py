"""Runs of one step under a class table or plain autocast (precision/runner.py), Trainer-free: each run from the same
state, the autocast run what torch.autocast gives by hand, the comparisons as computed directly, the model as before."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_opkit.precision.runner import StepRunner, grad_cosine, loss_change, record_ops, step_error


def _setup():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.2), nn.GELU(), nn.Linear(32, 1))
    batch = torch.randn(8, 16)
    return net, StepRunner(net, batch, lambda m, b: m(b).square().mean())


def test_every_run_starts_from_the_same_rng_and_buffers_and_leaves_the_model_as_it_was():
    net, runner = _setup()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with runner.session():
        first, grads_a = runner.run()
        second, grads_b = runner.run()
        assert torch.equal(first, second)  # same dropout mask, same BatchNorm statistics
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())
    with pytest.raises(AssertionError, match="outside session"):
        runner.run()


def test_the_autocast_run_is_torch_autocast_s_by_hand():
    net, runner = _setup()
    rng = torch.get_rng_state()
    with runner.session():
        got, _ = runner.run(autocast=torch.bfloat16)
    torch.set_rng_state(rng)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = net(runner.batch).square().mean()
    assert torch.equal(got, expected.float().detach())


def test_a_table_lowers_its_classes_and_the_log_sees_the_step_s_ops():
    net, runner = _setup()
    with runner.session():
        log, ref, _ = record_ops(runner)
        low, _ = runner.run({"matmul": "bf16"})
    assert {cls for cls, *_ in log.examples.values()} >= {"matmul", "norm", "activation"}
    assert low != ref  # the GEMMs in bf16 change the loss a little
    assert loss_change(low, ref) < 0.05


def test_loss_change_and_grad_cosine_as_computed_directly():
    a, b = torch.tensor(2.0), torch.tensor(2.5)
    assert loss_change(a, b) == pytest.approx(0.2)
    assert loss_change(torch.tensor(float("nan")), b) == math.inf
    g = [torch.tensor([1.0, 0.0]), None, torch.tensor([2.0])]
    r = [torch.tensor([1.0, 1.0]), torch.ones(3), torch.tensor([2.0])]
    direct = F.cosine_similarity(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([1.0, 1.0, 2.0]), dim=0).item()
    assert grad_cosine(g, r) == pytest.approx(direct)
    assert grad_cosine([None], [None]) is None
    assert grad_cosine([torch.tensor([float("inf")])], [torch.tensor([1.0])]) == -1.0


def test_step_error_is_the_larger_of_the_loss_change_and_one_minus_the_cosine():
    assert step_error(1e-4, 0.999) == pytest.approx(1e-3)
    assert step_error(1e-2, 0.999) == pytest.approx(1e-2)
    assert step_error(1e-4, None) == pytest.approx(1e-4)
    assert step_error(None, 1.0) == math.inf
