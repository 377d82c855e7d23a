"""NaNDetector's report (nan/report.py): its dict view and back, its words, the notes amended to it, the error that
carries it across processes, and what it writes to TensorBoard (read back with TensorBoard's EventAccumulator)."""

import pickle

import lightning.pytorch as pl
from helpers import read_events

from lightning_opkit.core.logging import LogWriter
from lightning_opkit.nan.report import (
    Cause,
    NaNReport,
    NonFiniteError,
    Origin,
    amended,
    format_report,
    not_reproduced,
    write_report,
)

_FORWARD = Origin(phase="forward", module="blocks.2.mlp", module_type="Linear", op_class="matmul", dtype="bfloat16",
                  nan=3, inf=1, input_min=-2.0, input_max=5.0, input_absmax=5.0)


def test_the_dict_view_round_trips_and_leaves_out_the_replay_order():
    report = NaNReport(7, 1, 3, 0, _FORWARD, Cause("precision", "finite in fp32"), action="skip")
    view = report.as_dict()
    assert "seq" not in view
    assert view["module"] == "blocks.2.mlp"
    assert view["cause"] == "precision"
    assert NaNReport.from_dict(view) == report
    assert NaNReport.from_dict({**view, "unknown_key": 1}) == report


def test_the_words_name_the_module_its_class_dtype_and_counts():
    text = format_report(NaNReport(7, 1, 3, 0, _FORWARD))
    assert text.startswith("Non-finite output at global step 7, first produced in the forward pass by module"
                           " 'blocks.2.mlp' (Linear, op class matmul) in dtype bfloat16: its output had 3 NaN and"
                           " 1 Inf")
    assert "while its inputs were finite (min -2, max 5, abs-max 5)" in text
    unseen = format_report(NaNReport(7, 1, 3, 0, Origin(phase="backward", module=None)))
    assert "not reproduced" in unseen
    spike = NaNReport(9, 0, 4, 0, Origin(phase="loss", module="enc"), kind="spike", loss=12.5, zscore=8.25,
                      top_parameters=("fc.weight (40.0x)",))
    assert format_report(spike) == ("Loss spike at global step 9 (batch 4): loss 12.5, 8.2 deviations above the recent"
                                    " good steps; the first module whose outputs departed from the last good batch's:"
                                    " 'enc'; gradients jumped most in fc.weight (40.0x).")


def test_amended_adds_what_was_done_and_what_cannot_be():
    report = NaNReport(7, 1, 3, 0, _FORWARD, Cause("precision", "finite in fp32"))
    fixed = amended(report, scaler=True, pinned_before=False, repair="blocks.2.mlp -> fp32")
    assert fixed.repair == "blocks.2.mlp -> fp32"
    assert "loss scaling cannot fix a forward overflow" in fixed.cause.advice
    assert "repaired: 'blocks.2.mlp' runs in fp32 from the next step on" in fixed.cause.advice
    assert amended(report, scaler=False, pinned_before=False, repair=None) == report
    no_cause = NaNReport(7, 1, 3, 0, _FORWARD)
    assert amended(no_cause, scaler=True, pinned_before=True, repair="x") is no_cause


def test_not_reproduced_says_whether_the_step_ran_compiled():
    assert "compiled code" in not_reproduced(compiled=True).advice
    assert "compiled" not in not_reproduced(compiled=False).advice
    assert "second replay as is" in not_reproduced(compiled=False, by_replay_as_is=True).advice


def test_the_error_carries_the_report_through_a_pickle():
    report = NaNReport(7, 1, 3, 0, _FORWARD, Cause("precision", "finite in fp32"))
    error = NonFiniteError(report, reason="skipped too often.")
    assert str(error).startswith("skipped too often. Non-finite output at global step 7")
    again = pickle.loads(pickle.dumps(error))
    assert type(again).__module__ == "lightning_opkit"
    assert again.report == error.report
    assert again.nan_report == report


def test_write_report_writes_the_report_and_cause_texts(tmp_path):
    writer = LogWriter(pl.Trainer(logger=False, enable_progress_bar=False), log_dir=str(tmp_path))
    report = NaNReport(7, 1, 3, 0, _FORWARD, Cause("precision", "finite in fp32"))
    write_report(writer, report, step=7)
    writer.close()
    _, texts = read_events(str(tmp_path))
    (step, text), = texts["opkit/nan/report"]
    assert step == 7
    assert text.startswith(format_report(report))
    assert "| module | blocks.2.mlp |" in text
    assert texts["opkit/nan/cause"] == [(7, "**precision**: finite in fp32")]
