"""How the policy is shown and told to the kit (precision/view.py), Trainer-free: the policy table, the census written
through a real LogWriter and read back with EventAccumulator, the summary lines, the facts, float8's fact as the sum of
its rows' times computed here."""

import lightning.pytorch as pl
import pytest
import torch
from helpers import read_events

from lightning_opkit.core.facts import RunFacts
from lightning_opkit.core.logging import LogWriter
from lightning_opkit.opclass import OP_CLASSES
from lightning_opkit.precision.census import Census
from lightning_opkit.precision.decide import Decision
from lightning_opkit.precision.fp8_measure import Fp8Measurements, Fp8Row
from lightning_opkit.precision.results import Measurement, PrecisionMeasurements
from lightning_opkit.precision.view import fp8_fact, policy_markdown, record_facts, summary_lines, write_census

_TABLE = {**dict.fromkeys(OP_CLASSES, "keep"), "matmul": "bf16", "norm": "fp32", "softmax": "fp32"}


def test_the_policy_table_gives_each_class_its_dtype_and_why_then_the_overrides():
    decisions = {"matmul": Decision("matmul", "bf16", "2.00x faster than fp32")}
    text = policy_markdown(_TABLE, decisions, {"head": "fp32"}, waiting=False)
    assert "| matmul | bf16 | 2.00x faster than fp32 |" in text
    assert "| norm | fp32 | - |" in text
    assert text.splitlines()[-1] == "| module head | fp32 | module override |"
    assert policy_markdown(_TABLE, {}, {}, waiting=True).startswith("rules='auto': every class in fp32 until measured")


def test_the_census_is_read_back_per_class(tmp_path):
    census = Census()
    x = torch.linspace(1, 2, 32)
    census.record("matmul", x.bfloat16(), False, ref=x)
    census.record("matmul", x.bfloat16(), False, ref=x)
    census.record("norm", x, False)
    writer = LogWriter(pl.Trainer(logger=False, enable_progress_bar=False), log_dir=str(tmp_path))
    rows = census.rows()
    write_census(writer, rows, _TABLE, step=5)
    writer.close()
    scalars, texts = read_events(str(tmp_path))
    assert scalars["opkit/precision/matmul/calls"] == [(5, 2.0)]
    matmul = next(r for r in rows if r.op_class == "matmul")
    assert scalars["opkit/precision/matmul/rel_error"][0][1] == pytest.approx(matmul.rel_error, rel=1e-6)
    assert "opkit/precision/norm/rel_error" not in scalars  # fp32: no error to show
    assert texts["opkit/precision/census"][0][0] == 5


def test_summary_lines_group_classes_by_dtype_and_name_overrides():
    lines = summary_lines(_TABLE, {}, {"head": "fp32"}, autocast=None, aside="", auto=None)
    assert lines[0] == ("precision policy: matmul in bf16; conv, attention, activation, loss, reduction, pointwise,"
                        " embedding, rnn keep; norm, softmax in fp32")
    assert lines[1] == "  module overrides: head -> fp32"
    plain = summary_lines(_TABLE, {}, {}, autocast="bf16", aside="the mode stands aside", auto=None)
    assert "plain torch.autocast in bf16" in plain[0]
    assert plain[1] == "  the mode stands aside"


def test_facts_say_what_runs_in_which_dtype_what_was_measured_and_why_a_class_stayed_in_fp32():
    facts = RunFacts()
    decisions = {"norm": Decision("norm", "fp32", "bf16 is 1.50x slower")}
    measured = PrecisionMeasurements([Measurement("matmul", "bf16", time_ratio=0.5),
                                      Measurement("norm", "bf16", failed="no kernel")])
    record_facts(facts, _TABLE, decisions, measured, "PrecisionPolicy(rules='auto') at step 0")
    assert facts.dtypes == {"matmul": "bf16", "norm": "fp32", "softmax": "fp32"}
    assert facts.kept_fp32 == {"norm": "bf16 is 1.50x slower", "softmax": "set to fp32 by its rules"}
    assert set(facts.speeds) == {("matmul", "bf16")}  # a failed row is no speed
    assert facts.speeds[("matmul", "bf16")].ratio == 0.5


def test_under_plain_autocast_the_facts_name_autocast_s_dtype_for_the_gemm_classes_it_lowers():
    facts = RunFacts()
    plain = dict.fromkeys(OP_CLASSES, "keep")  # what the policy's table says when plain autocast won
    record_facts(facts, plain, {}, None, "PrecisionPolicy(rules='auto') at step 0", autocast="bf16")
    assert facts.dtypes == {"matmul": "bf16", "conv": "bf16", "attention": "bf16"}  # the rest: their inputs' dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what autocast does with each, observed
        x, w = torch.randn(4, 8), torch.randn(8, 8)
        assert torch.nn.functional.linear(x, w).dtype == torch.bfloat16
        assert torch.nn.functional.conv1d(x.T[None], w[:, :, None]).dtype == torch.bfloat16
        assert torch.nn.functional.layer_norm(x, (8,)).dtype == torch.float32


def test_float8_s_fact_is_its_rows_times_summed():
    rows = (Fp8Row("a", (64, 64), base_ms=2.0, fp8_ms=1.0, verdict=None),  # chosen
            Fp8Row("b", (64, 64), base_ms=6.0, fp8_ms=9.0, verdict="slower"), Fp8Row("c", (64, 64)))
    fact = fp8_fact(Fp8Measurements(rows, "tensorwise", 0.01), "auto")
    assert fact.speed.ratio == pytest.approx(10.0 / 8.0)  # both timed rows together
    assert fact.chosen == ("a",)
    assert fact.chosen_speed.ratio == pytest.approx(0.5)
    assert fp8_fact(Fp8Measurements((Fp8Row("c", (64, 64)),), "tensorwise", 0.01), "auto") is None
