"""A GradScaler's collapse (nan/scaler.py), watched on a real torch.amp.GradScaler fed overflowing gradients."""

import torch

from lightning_opkit.nan.scaler import COLLAPSE, ScaleWatch, collapse_cause


def _overflowing_steps(n: int) -> list[float]:
    """The scale a real GradScaler reports after each of ``n`` steps whose gradients overflow."""
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scales = []
    for _ in range(n):
        optimizer.zero_grad()
        scaler.scale((param * float("inf")).sum()).backward()
        scaler.step(optimizer)  # skipped: the gradients are not finite
        scaler.update()  # and the scale halves
        scales.append(float(scaler.get_scale()))
    assert param.tolist() == [1.0, 1.0]  # every step was left out
    return scales


def test_a_real_scaler_s_fall_by_two_to_the_ten_is_a_collapse_reported_once():
    watch = ScaleWatch()
    reported = [watch.skipped_step(scale) for scale in _overflowing_steps(14)]
    # the scale as each skipped step saw it halves from its first: 2^10 below that after ten more steps
    assert reported.index(True) == 10
    assert reported.count(True) == 1
    first = 2.0**15
    assert watch.first == first
    assert "fell from 32768 to" in watch.describe(first / COLLAPSE)
    assert "over 14 steps it skipped in a row" in watch.describe(first / COLLAPSE)


def test_a_step_that_goes_through_ends_the_run_of_skips():
    watch = ScaleWatch()
    for scale in _overflowing_steps(9):
        assert not watch.skipped_step(scale)
    watch.healthy()
    assert (watch.first, watch.skipped) == (None, 0)
    assert not any(watch.skipped_step(scale) for scale in _overflowing_steps(9))  # nine again: no collapse


def test_the_cause_names_the_module_and_the_override_that_fixes_it():
    cause = collapse_cause("the scale fell", "blocks.3.mlp")
    assert cause.cause == "precision"
    assert "PrecisionPolicy(overrides={'blocks.3.mlp': 'fp32'})" in cause.advice
    assert "a module no replay named" in collapse_cause("the scale fell", None).advice
