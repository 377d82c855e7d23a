"""Each op class's dtype from measured rows (precision/decide.py): the bars a 16-bit dtype must pass, each refusal in
words, and the tie rule. Rows are built by hand: the decision, not the measurement, is under test."""

import pytest

from lightning_opkit.precision.decide import DEFAULT_TOLERANCE, MIN_SPEEDUP, Decision, decide
from lightning_opkit.precision.results import Measurement


def _row(cls="matmul", dtype="bf16", ratio=0.5, loss=1e-3, cosine=0.9999, **kw):
    return Measurement(cls, dtype, time_ratio=ratio, loss_change=loss, grad_cosine=cosine, **kw)


def test_a_fast_accurate_dtype_is_chosen_with_its_evidence():
    (decision,) = decide([_row()]).values()
    assert decision == Decision("matmul", "bf16", decision.reason)
    assert decision.reason.startswith("2.00x faster than fp32, loss change 1.00e-03, grad cosine 0.99990")


@pytest.mark.parametrize("row, why", [
    (_row(ratio=1.0 / MIN_SPEEDUP + 0.01), "needs 1.05x faster"),
    (_row(loss=DEFAULT_TOLERANCE * 2), "changes the loss by 2.00e-02 > tolerance 0.01"),
    (_row(cosine=0.98), "gradient cosine 0.98000 < 1 - tolerance"),
    (_row(failed="no bf16 kernel"), "bf16 failed (no bf16 kernel)"),
    (_row(ratio=None), "bf16 speed not measured"),
    (_row(loss=None), "bf16 error not measured"),
])
def test_each_bar_refuses_in_words_and_keeps_fp32(row, why):
    (decision,) = decide([row]).values()
    assert decision.dtype == "fp32"
    assert why in decision.reason


def test_a_saving_too_small_to_notice_is_refused():
    rows = [_row("matmul", ratio=0.5, fp32_ms=100.0), _row("norm", ratio=0.5, fp32_ms=0.5)]
    decisions = decide(rows)
    assert decisions["matmul"].dtype == "bf16"
    assert decisions["norm"].dtype == "fp32"
    assert "would save 0.250 of 100.50 ms per step (< 1%)" in decisions["norm"].reason


def test_the_fastest_acceptable_dtype_wins_and_the_other_is_named():
    decisions = decide([_row(dtype="bf16", ratio=0.6), _row(dtype="fp16", ratio=0.4, loss=0.5)],
                       dtypes=("bf16", "fp16"))
    assert decisions["matmul"].dtype == "bf16"  # fp16 is faster but changes the loss too much
    assert "not fp16 changes the loss" in decisions["matmul"].reason
    # where fp16 is no candidate (no loss scaling), its row is not considered at all
    assert decide([_row(dtype="fp16", ratio=0.4)], dtypes=("bf16",))["matmul"].dtype == "fp32"


def test_speed_alone_where_errors_are_judged_later_and_classes_in_taxonomy_order():
    rows = [_row("norm", loss=None, cosine=None), _row("matmul", loss=None, cosine=None)]
    decisions = decide(rows, require_errors=False)
    assert list(decisions) == ["matmul", "norm"]
    assert {d.dtype for d in decisions.values()} == {"bf16"}


def test_a_tolerance_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="tolerance"):
        decide([_row()], tolerance=2.0)
