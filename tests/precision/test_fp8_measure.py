"""``rules="auto"`` and float8, per module: each Linear timed at its rows, its error measured alone and with the others,
the choice applied, checkpointed and replayed; on a CPU (no float8 units) measured only when asked, and kept slower.

On a CPU torch's float8 GEMM is a reference kernel (40x to 1400x a bf16 GEMM's time here), so nothing is chosen by
speed; the tests that follow a module into float8 pass ``min_speedup=0`` (speed then decides nothing) or bring a
decision in a checkpoint, as a run on a GPU would have written it.
"""

from __future__ import annotations

import pytest
import torch
from helpers import read_events, snapshot, trainer
from torch import nn
from zoo import build

from lightning_opkit import PrecisionPolicy, ProfilerWindows
from lightning_opkit.core.facts import FASTER, facts_of
from lightning_opkit.core.replay import rng_state
from lightning_opkit.core.text import times_phrase
from lightning_opkit.precision.decide import Decision
from lightning_opkit.precision.fp8 import Float8Linears, auto_candidates, gemm_dims
from lightning_opkit.precision.fp8_measure import Fp8Measurements, measure_fp8
from lightning_opkit.precision.plan import Plan
from lightning_opkit.precision.runner import StepRunner
from lightning_opkit.profiler.roofline.levers import lever

CPU = torch.device("cpu")


def _measure(case="hf_llama", **kwargs) -> tuple[nn.Module, Fp8Measurements, tuple]:
    model = build(case)
    batch = next(iter(model.loader(n=8)))
    runner = StepRunner(model, batch, lambda m, b: m(b))
    with runner.session():
        found = measure_fp8(runner, list(model.named_modules()), CPU, **kwargs)
    return model, found, batch


def test_each_linear_is_timed_at_its_rows_and_its_error_measured_alone_leaving_the_model_as_it_was():
    model = build("hf_llama")
    batch = next(iter(model.loader(n=8)))  # (a DataLoader's iterator draws its seed from the RNG)
    before, rng = snapshot(model), rng_state()
    runner = StepRunner(model, batch, lambda m, b: m(b))
    with runner.session():
        found = measure_fp8(runner, list(model.named_modules()), CPU, min_speedup=0.0, scale=2.0)
    gemms = [n for n, m in model.named_modules() if gemm_dims(m) is not None]
    assert [r.module for r in found.rows] == gemms
    rows = {r.module: r for r in found.rows}
    ids = batch[0]
    # every projection multiplies each token of the batch once; scale=2 times them at twice the measured rows
    assert rows["model.model.layers.0.self_attn.q_proj"].tokens == (2 * ids.numel(),)
    assert rows["model.model.layers.0.mlp.down_proj"].dims == (64, 32)
    for row in found.rows:
        assert row.base_ms > 0
        assert row.fp8_ms > 0
        assert row.loss_change is not None
        assert row.grad_cosine is not None
        if row.error > found.tolerance:
            assert row.verdict == f"error {row.error:.2e} > tolerance {found.tolerance:g}"
        else:  # chosen, unless the chosen ones missed the tolerance together
            assert row.chosen or row.verdict.startswith("within tolerance alone, not with the others")
        assert row.chosen == (row.module in found.chosen)
    assert found.chosen, "float8's error on the zoo Llama is within 1% for some Linear"
    if len(found.chosen) > 1:
        assert found.together is not None
        assert max(found.together[0], 1 - found.together[1]) <= found.tolerance
    # nothing of the measurement stays: weights, patches, the RNG
    assert snapshot(model) == before
    assert not [n for n, m in model.named_modules() if "forward" in vars(m)]
    assert torch.equal(rng_state()[0], rng[0])


def test_a_linear_float8_cannot_take_is_named_and_not_timed():
    _, found, _ = _measure("hf_bert", min_speedup=0.0)
    odd = [r for r in found.rows if any(d % 16 for d in r.dims)]
    assert odd, "the zoo BERT has a classifier of 3 outputs"
    for row in odd:
        assert row.verdict == f"{row.dims[0]}x{row.dims[1]}: float8 GEMMs need dimensions that are multiples of 16"
        assert row.base_ms is None
        assert row.fp8_ms is None
        assert not row.chosen


def test_float8_that_is_not_faster_is_kept_and_the_verdict_is_the_recorded_times():
    _, found, _ = _measure()
    for row in found.rows:
        fast = row.fp8_ms * FASTER <= row.base_ms
        if not fast:
            assert row.verdict == f"{times_phrase(row.time_ratio)} than bf16; needs {FASTER:.2f}x faster"
            assert row.loss_change is None  # no step run for a module speed already ruled out
        assert row.chosen == (fast and row.error <= found.tolerance)
    kept = [line for line in found.lines() if line.startswith("  fp8 (auto): kept in bf16: ")]
    assert len(kept) == (1 if len(found.chosen) < len(found.rows) else 0)


def test_modules_within_tolerance_alone_but_not_together_are_dropped_worst_alone_first():
    _, loose, _ = _measure(min_speedup=0.0, tolerance=1.0)
    alone = {r.module: r.error for r in loose.rows}
    tolerance = max(alone.values()) * (1 + 1e-6)  # every module passes alone
    together = max(loose.together[0], 1 - loose.together[1])
    assert together > tolerance, (together, tolerance)  # errors of many float8 GEMMs add up
    _, found, _ = _measure(min_speedup=0.0, tolerance=tolerance)
    dropped = [r for r in found.rows if not r.chosen]
    assert max(alone, key=alone.__getitem__) in {r.module for r in dropped}
    for row in dropped:
        assert row.verdict.startswith(("within tolerance alone, not with the others (together: error",
                                       "the chosen modules together miss tolerance"))
    # the drops go by alone error: every kept module erred less alone than every dropped one (save the last resort)
    if found.chosen:
        assert max(alone[m] for m in found.chosen) <= min(alone[r.module] for r in dropped)
        assert found.together is None or max(found.together[0], 1 - found.together[1]) <= tolerance


def test_auto_measures_what_no_override_pin_or_rule_decides_and_says_why_it_tries_nothing():
    model = nn.Sequential(nn.Linear(32, 32), nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), nn.Linear(32, 32))
    fp8 = Float8Linears("tensorwise", census=lambda: None)
    fp8.convert([("2", model[2])], CPU)  # a rule's float8 module: not auto's to decide
    picked, note = auto_candidates(model, fp8, {"1": "bf16"}, True, CPU)
    assert ([n for n, _ in picked], note) == (["0"], "")
    fp8.choose({"0": "1.5x faster"}, model)
    picked, _ = auto_candidates(model, fp8, {}, True, CPU)
    assert [n for n, _ in picked] == ["0", "1.0", "1.1"]  # a re-measurement decides auto's own again
    assert auto_candidates(model, fp8, {}, False, CPU) == ([], "try_fp8=False")
    assert auto_candidates(model, fp8, {}, None, CPU)[1].startswith("a CPU has no float8 GEMM units")
    fp8.restore()


def _fp8(why):
    return Decision("matmul", "fp8", why)


def test_a_new_choice_reverts_the_modules_it_no_longer_takes_and_a_pin_ends_one_for_good():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    fp8 = Float8Linears("tensorwise", census=lambda: None)
    fp8.choose({"0": _fp8("1.5x faster")}, model)
    assert (fp8.live, fp8.by_auto) == (["0"], {"0": _fp8("1.5x faster")})
    fp8.choose({"1": _fp8("1.3x faster")}, model)
    assert (fp8.live, fp8.by_auto) == (["1"], {"1": _fp8("1.3x faster")})
    assert "forward" not in vars(model[0])
    assert "forward" in vars(model[1])
    assert fp8.revert("1")  # a NaN repair's pin
    assert (fp8.live, fp8.by_auto) == ([], {})
    assert "forward" not in vars(model[1])
    fp8.choose({"0": _fp8("1.5x faster"), "1": _fp8("1.3x faster")}, model)  # a trial's end, say: the pin holds
    assert (fp8.live, fp8.by_auto) == (["0"], {"0": _fp8("1.5x faster")})
    # an override decides: not auto's to choose
    fp8.choose({"0": _fp8("1.5x faster")}, model, overrides={"0": "fp32"})
    assert (fp8.live, fp8.by_auto) == ([], {})
    fp8.reset()
    assert "forward" not in vars(model[0])


def test_try_fp8_is_checked_at_construction():
    with pytest.raises(ValueError, match=r"Expected `try_fp8` to be one of \[None, True, False\], but got 'yes'"):
        PrecisionPolicy(rules="auto", try_fp8="yes")


def test_rules_auto_with_try_fp8_on_a_cpu_measures_each_linear_and_shows_the_figures(tmp_path):
    model = build("hf_gpt2")  # its projections are Hugging Face Conv1D modules
    policy = PrecisionPolicy(rules="auto", census_every_n_steps=0, trial_steps=0, try_fp8=True)
    windows = ProfilerWindows(every_n_steps=2, warmup=0, active=1, roofline=True, export_trace=False)
    run = trainer(tmp_path, [policy, windows], max_steps=3, max_epochs=-1, precision="bf16-mixed")
    run.fit(model, model.loader(n=16))
    # the kit's fact of it, and the roofline's matmul lever, which rests on it
    fact = facts_of(run).fp8
    assert fact.timed == sum(1 for m in model.modules() if gemm_dims(m) is not None)
    assert fact.chosen == ()
    assert f"{fact.speed.phrase()}: no float8 lever here" in lever(windows.last_roofline.rows["matmul"],
                                                                   windows.last_roofline)
    _, texts = read_events(str(tmp_path))
    decision = texts["opkit/precision/decision"][-1][1]
    assert "float8 per GEMM module (tensorwise scaling, torchao)" in decision
    assert "| model.transformer.h.0.attn.c_attn | 32x96 |" in decision
    summary = texts["opkit/summary"][-1][1]
    assert "fp8 (auto, measured in" in summary
    assert not policy.fp8.converted  # a CPU's reference float8 GEMM is many times bf16's (see the module docstring)
    assert policy.state_dict()["plan"]["fp8"] == {}
    assert not [n for n, m in model.named_modules() if "forward" in vars(m)]


def test_a_checkpointed_float8_decision_runs_again_on_resume_without_measuring(tmp_path):
    module = "model.model.layers.0.mlp.up_proj"
    first = PrecisionPolicy(rules="auto", census_every_n_steps=1, trial_steps=0)
    # the decision a GPU run would have checkpointed: GEMMs in bf16, one MLP Linear in float8
    first.load_state_dict({"plan": Plan({"matmul": Decision("matmul", "bf16", "1.8x faster than fp32")},
                                        fp8={module: _fp8("1.42x faster than bf16")}).state()})
    model = build("hf_llama")
    run = trainer(tmp_path / "a", [first], max_steps=2, max_epochs=-1, precision="bf16-mixed")
    run.fit(model, model.loader(n=16))
    assert first.measurements is None  # run from the checkpoint's plan, nothing measured
    assert ("matmul", "fp8") in first.census
    path = tmp_path / "a.ckpt"
    run.save_checkpoint(path)
    again = PrecisionPolicy(rules="auto", census_every_n_steps=1, trial_steps=0)
    resumed = build("hf_llama")
    trainer(tmp_path / "b", [again], max_steps=4, max_epochs=-1, precision="bf16-mixed").fit(
        resumed, resumed.loader(n=16), ckpt_path=path)
    assert again.measurements is None
    assert again.fp8.converted == [module]
    assert again.fp8.by_auto == {module: _fp8("1.42x faster than bf16 (measured before the checkpoint)")}
    assert ("matmul", "fp8") in again.census
    assert f"overrides={{'{module}': 'fp8'}}" in again.decision_as_arguments()
    _, texts = read_events(str(tmp_path / "b"))
    assert f"| {module} | fp8 | rules='auto': 1.42x faster than bf16" in texts["opkit/precision/policy"][-1][1]
    assert f"fp8: 1 GEMM module(s) in float8 by rules='auto', e.g. {module} (1.42x" in texts["opkit/summary"][-1][1]
    assert not [n for n, m in resumed.named_modules() if "forward" in vars(m)]


def test_a_float8_overflow_in_a_module_auto_chose_is_repaired_and_the_checkpoint_keeps_the_repair(tmp_path):
    from lightning_opkit import NaNDetector
    from precision.test_fp8 import OutlierNet

    torch.manual_seed(0)
    model = OutlierNet()
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randint(0, 16, (64,), generator=g))
    policy = PrecisionPolicy(rules="auto", census_every_n_steps=0, trial_steps=0)
    policy.load_state_dict({"plan": Plan({"matmul": Decision("matmul", "fp32", "measured")},
                                         fp8={"proj": _fp8("1.5x faster"), "head": _fp8("1.2x faster")}).state()})
    detector = NaNDetector(action="skip")
    trainer(tmp_path, [policy, detector], max_steps=5, precision="32-true").fit(
        model, torch.utils.data.DataLoader(data, batch_size=8))
    assert [(e["step"], e["module"], e["cause"], e["repair"]) for e in detector.events] == [
        (2, "proj", "precision", "proj -> fp32")]
    assert policy.fp8.live == []
    assert policy.fp8.held == {"proj"}
    assert policy.fp8.converted == ["head"]  # what ran to the end
    # the checkpoint and the arguments that run it again: float8 as it ran, without the repaired module
    assert policy.state_dict()["plan"]["fp8"] == {"head": "1.2x faster (measured before the checkpoint)"}
    assert policy.decision_as_arguments().endswith("overrides={'head': 'fp8'})")
