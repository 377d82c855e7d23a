"""One kit: no lever contradicts a measurement of the same run, and each fact is stated once.

The example ViT with ``rules="auto"`` and ``ProfilerWindows(roofline=True)``: bf16 matmul measured slower at the
model's shapes (injected, and as measured on this machine, whichever way it comes out) must not come back from the
roofline as "lower matmul to bf16".
"""

import pytest
import torch
from helpers import read_events, trainer
from precision.test_auto import Injected, _row

from examples.vit import DigitsDataModule, ViTClassifier
from lightning_opkit import PrecisionPolicy, ProfilerWindows
from lightning_opkit.core.facts import Fp8Fact, RunFacts, SpeedFact, facts_of, new_facts

SUGGESTION = "PrecisionPolicy(rules={'matmul': 'bf16'})"


def _fit(tmp_path, policy):
    windows = ProfilerWindows(every_n_steps=4, warmup=1, active=2, roofline=True, export_trace=False)
    run = trainer(tmp_path, [policy, windows], max_steps=8, limit_val_batches=0)
    torch.manual_seed(0)
    run.fit(ViTClassifier(), DigitsDataModule(batch_size=64))
    _, texts = read_events(str(tmp_path))
    return run, windows, texts["opkit/profiler/roofline"][-1][1], texts["opkit/summary"][-1][1]


def test_bf16_measured_slower_is_not_advised_back(tmp_path):
    rows = [_row("matmul", speed=2.5, loss=None, cos=None), _row("conv", speed=1.4, loss=None, cos=None),
            _row("norm", speed=1.3, loss=None, cos=None), _row("activation", speed=1.1, loss=None, cos=None)]
    policy = Injected(rows, census_every_n_steps=0, whole_step=False)
    run, windows, table, summary = _fit(tmp_path, policy)
    assert policy.table["matmul"] == "fp32"
    fact = facts_of(run).speeds[("matmul", "bf16")]
    assert fact.ratio == 2.5
    assert fact.source == "PrecisionPolicy(rules='auto') at step 0"
    assert SUGGESTION not in table
    assert SUGGESTION not in summary
    # the matmul lever names the measurement it rests on instead
    matmul_lever = next(line for line in table.splitlines() if line.startswith("- **matmul**"))
    assert "kept in fp32 by the precision policy" in matmul_lever
    assert fact.phrase() in matmul_lever
    assert summary.count("2.50x slower") <= 2  # the policy's decision line, and at most a lever pointing back at it


@pytest.mark.slow
def test_as_measured_here_no_lever_contradicts_the_policy(tmp_path):
    policy = PrecisionPolicy(rules="auto", census_every_n_steps=0, trial_steps=0)
    run, windows, table, summary = _fit(tmp_path, policy)
    facts = facts_of(run)
    matmul = windows.last_roofline.rows["matmul"]
    if policy.table["matmul"] == "fp32":
        # kept in fp32: the roofline does not advise bf16, whatever the square GEMM peaks say
        assert SUGGESTION not in table
        assert "kept in fp32 by the precision policy" in table
    else:
        # lowered: the window's GEMMs ran in 16-bit, and there is nothing to advise
        assert not matmul.dtype.startswith("fp32")
        assert SUGGESTION not in table
    # what the kit says the class ran in is what the window's GEMMs ran in, also where plain autocast won (its table
    # says "keep": autocast decides, and lowers GEMMs)
    assert facts.dtypes["matmul"] == matmul.dtype.split("+")[0]
    assert policy.table["matmul"] in (facts.dtypes["matmul"], "keep")


# Trainer-free: the facts themselves


def test_a_class_s_speed_is_its_fastest_16_bit_measurement_and_says_which():
    facts = RunFacts()
    assert facts.speed("matmul") is None  # not measured in this run
    facts.speeds[("matmul", "bf16")] = SpeedFact("matmul", "bf16", 1.4, "3 GEMM shapes", "auto, step 0")
    facts.speeds[("matmul", "fp16")] = SpeedFact("matmul", "fp16", 0.8, "3 GEMM shapes", "auto, step 0")
    facts.speeds[("norm", "bf16")] = SpeedFact("norm", "bf16", 0.5, "1 shape", "auto, step 0")
    fastest = facts.speed("matmul")
    assert (fastest.dtype, fastest.faster) == ("fp16", True)
    assert facts.speeds[("matmul", "bf16")].phrase() == \
        "bf16 measured 1.40x slower than fp32 at 3 GEMM shapes (auto, step 0)"


def test_float8_s_fact_says_what_runs_in_float8_or_that_nothing_does():
    speed = SpeedFact("matmul", "fp8", 0.7, "6 Linears", "auto", baseline="bf16")
    assert Fp8Fact(speed, (), 6).phrase().endswith(": no float8 lever here")
    chosen = Fp8Fact(speed, ("a", "b"), 6, SpeedFact("matmul", "fp8", 0.5, "2 Linears", "auto", baseline="bf16"))
    assert chosen.phrase() == \
        "float8 runs 2 of 6 timed Linears (fp8 measured 2.00x faster than bf16 at 2 Linears (auto))"


def test_each_trainer_has_its_own_facts_and_a_new_fit_starts_them_afresh():
    one, two = object.__new__(_Key), object.__new__(_Key)
    facts_of(one).repairs["head"] = "fp32"
    assert facts_of(one).repairs == {"head": "fp32"}
    assert facts_of(two).repairs == {}
    assert new_facts(one).repairs == {}
    assert facts_of(one).repairs == {}


class _Key:
    """Anything a weak reference can point at stands for a Trainer here."""
