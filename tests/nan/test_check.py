"""The one cheap check (nan/check.py): flags for the loss and every gradient from one fused reduction, the values a
spike is scored on, and a non-finite norm from finite but huge gradients told apart from a real NaN/Inf."""

import math

import torch

from lightning_opkit.nan.check import OUTCOMES, Checked, all_finite, check, flags, outcome


def test_a_finite_step_flags_nothing_and_hands_on_its_log_values():
    grads = [torch.full((3,), 3.0), torch.full((4,), 4.0)]
    checked = check([torch.tensor(2.0), torch.tensor(4.0)], grads, torch.device("cpu"))
    assert (checked.loss_bad, checked.grad_bad, checked.dead) == (False, False, False)
    assert math.isclose(checked.values[0], math.log1p(3.0), rel_tol=1e-6)  # the micro-batches' mean loss, through log1p
    assert math.isclose(checked.values[1], math.log(math.sqrt(9 * 3 + 16 * 4)), rel_tol=1e-6)
    assert checked.norms.tolist() == [torch.tensor(27.0).sqrt().item(), 8.0]


def test_a_nan_loss_and_an_inf_gradient_are_each_flagged():
    checked = check([torch.tensor(float("nan"))], [torch.tensor([1.0, float("inf")])], torch.device("cpu"))
    assert checked.loss_bad
    assert checked.grad_bad


def test_a_finite_gradient_whose_norm_overflows_is_not_a_fault():
    big = torch.full((8,), 60000.0, dtype=torch.half)  # fp16 gradients whose norm passes 65504: finite all the same
    assert not check([torch.tensor(1.0)], [big], torch.device("cpu")).grad_bad
    found, _, _ = flags([], [big], torch.device("cpu"))
    assert math.isfinite(found[1].item())  # the norm is taken in fp32
    assert math.isclose(found[1].item(), 60000.0 * math.sqrt(8), rel_tol=1e-6)


def test_all_finite_over_tensors_of_several_dtypes():
    assert bool(all_finite([torch.ones(2), torch.ones(2, dtype=torch.bfloat16)]))
    assert not bool(all_finite([torch.ones(2), torch.tensor([float("-inf")], dtype=torch.half)]))


def test_outcome_is_the_one_decision_of_a_checked_step():
    asked = []

    def forward_fault(answer):
        return lambda: asked.append(answer) or answer

    healthy, nan_loss, nan_grads = Checked(False, False), Checked(True, False), Checked(False, True)
    assert outcome(healthy, None, scaler=False, forward_fault=forward_fault(False)) == "healthy"
    assert outcome(healthy, "loss", scaler=False, forward_fault=forward_fault(False)) == "spike"
    assert outcome(nan_loss, None, scaler=True, forward_fault=forward_fault(False)) == "non-finite"
    assert asked == []  # the forward replays are asked for nothing but non-finite gradients under a scaler
    assert outcome(nan_grads, None, scaler=True, forward_fault=forward_fault(False)) == "scaler overflow"
    assert outcome(nan_grads, None, scaler=True, forward_fault=forward_fault(True)) == "non-finite"
    assert outcome(nan_grads, None, scaler=False, forward_fault=forward_fault(True)) == "non-finite"
    assert asked == [False, True]
    assert set(OUTCOMES) == {"healthy", "spike", "scaler overflow", "non-finite"}


def test_non_finite_values_reach_the_host_as_inf_whatever_their_sign_and_the_logs_are_taken_there():
    for bad in (float("nan"), float("inf"), float("-inf")):
        found, own, _ = flags([torch.tensor(bad)], [torch.tensor([bad, 1.0])], torch.device("cpu"))
        assert found.tolist() == [math.inf, math.inf]  # a collective's maximum keeps +inf, not a NaN
        assert not own.isfinite().any()  # this rank's own values stay as they were
    checked = check([torch.tensor(-3.0)], [torch.zeros(2)], torch.device("cpu"))
    assert not checked.loss_bad
    assert not checked.grad_bad
    assert checked.values[0] == -math.log1p(3.0)
    assert checked.values[1] < -60  # log of a zero norm, finite
