"""Every callback on every zoo model (tests/zoo): torch's own modules and Hugging Face models nobody here wrote."""

import math
import os

import pytest
import torch
from helpers import REFUSED, StepProbe, policy_refused_under, read_events, snapshot, state_differences, trainer
from zoo import CASES, build

from lightning_opkit import NaNDetector, PrecisionPolicy, ProfilerWindows, TorchCompile

NAMES = list(CASES)
FAULTS = {"forward": 1, "backward": 2, "param": 3, "loss": 4}


@pytest.mark.parametrize("name", NAMES)
def test_nan_is_named_exactly_and_skip_changes_nothing(tmp_path, name):
    model = build(name, faults=FAULTS)
    case = model.case
    before = snapshot(model)
    detector = NaNDetector(action="skip")
    probe = StepProbe(steps=FAULTS.values())
    trainer(tmp_path, [detector, probe], max_steps=6, max_epochs=-1).fit(model, model.loader())
    events = {e["step"]: e for e in detector.events}
    assert sorted(events) == sorted(FAULTS.values()), detector.events
    fwd, bwd, param, loss = (events[FAULTS[k]] for k in ("forward", "backward", "param", "loss"))
    assert (fwd["phase"], fwd["module"]) == ("forward", "model." + case.deep)
    assert fwd["op_class"] in ("matmul", "conv", "rnn")
    assert fwd["nan"] >= 1
    owner = "model." + case.param.rpartition(".")[0]
    assert (param["phase"], param["module"], param["parameter"]) == ("backward", owner, "model." + case.param)
    assert (loss["phase"], loss["module"]) == ("loss", "")
    assert bwd["phase"] == "backward"
    assert bwd["module"] == "model." + case.deep
    if bwd["parameter"] is not None:  # ReLU(inplace=True) refuses module backward hooks: parameters only
        assert name == "bn_cnn"
        assert bwd["parameter"].startswith("model." + case.deep + ".")
    for step in FAULTS.values():  # weights, optimizer state, buffers (BatchNorm) and LR bit-identical
        assert not state_differences(probe.before[step], probe.after[step]), (step, state_differences(
            probe.before[step], probe.after[step]))
    clean = [v for s, v in probe.losses.items() if s not in (FAULTS["forward"], FAULTS["loss"])]
    assert detector.skipped_steps == 4
    assert len(clean) == 4
    assert all(map(math.isfinite, clean))
    assert snapshot(model) == before


def _dtype_recorder(model, paths):
    seen = {}

    def hook(path):
        def record(module, args, output):
            out = output if isinstance(output, torch.Tensor) else output[0]
            seen.setdefault(path, set()).add(out.dtype)

        return record

    for path in paths:
        model.model.get_submodule(path).register_forward_hook(hook(path))
    return seen


def _policy_run(tmp_path, name, backend):
    model = build(name)
    case = model.case
    seen = _dtype_recorder(model, [case.gemm, case.norm, case.override])
    # check_speed on (the default): it times the ops the first step ran, so the dtype hooks see each step once
    policy = PrecisionPolicy(rules={"rnn": "bf16"}, overrides={"model." + case.override: "fp32"},
                             census_every_n_steps=0)
    callbacks = [policy]
    if backend is not None:
        callbacks.append(TorchCompile(modules=["model." + case.blocks], backend=backend))
    probe = StepProbe()
    trainer(tmp_path, [*callbacks, probe], max_steps=2).fit(model, model.loader())
    return case, seen, probe.losses, callbacks[-1]


_EAGER_LOSSES: dict[str, dict[int, float]] = {}


def _eager_losses(tmp_path, name):
    if name not in _EAGER_LOSSES:
        _EAGER_LOSSES[name] = _policy_run(tmp_path / "eager", name, None)[2]
    return _EAGER_LOSSES[name]


@pytest.mark.parametrize("backend", [None, "eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", NAMES)
def test_policy_dtypes_and_module_overrides_hold_compiled(tmp_path, name, backend):
    if policy_refused_under(backend):
        with pytest.raises(ValueError, match=REFUSED):
            _policy_run(tmp_path, name, backend)
        return
    case, seen, losses, compiler = _policy_run(tmp_path, name, backend)
    gemm_dtype = torch.float32 if name == "torch_lstm" else torch.bfloat16  # the LSTM case's "gemm" feeds the head
    assert seen[case.gemm] == {torch.bfloat16} or (name == "torch_lstm" and seen[case.gemm] == {gemm_dtype})
    assert seen[case.norm] == {torch.float32}, seen
    assert seen[case.override] == {torch.float32}, seen
    if backend is None:
        return
    assert compiler.watch.frames > 0
    assert compiler.error is None
    # What ran compiled is what the policy ran eagerly: same dtypes for every op, so the same losses (inductor fuses
    # and may round bf16 intermediates differently, within bf16's precision).
    eager = _eager_losses(tmp_path, name)
    tol = dict(rtol=2e-2, atol=0) if backend == "inductor" else dict(rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor([losses[s] for s in sorted(eager)]),
                               torch.tensor([eager[s] for s in sorted(eager)]), **tol)


@pytest.mark.parametrize("name", NAMES)
def test_profiler_windows_trace_and_classify(tmp_path, name):
    model = build(name)
    windows = ProfilerWindows(every_n_steps=2, warmup=0, active=2)
    trainer(tmp_path, [windows], max_steps=4).fit(model, model.loader())
    assert windows.windows_done == 1
    assert len(windows.trace_files) == 1
    assert os.path.getsize(windows.trace_files[0])
    # Shares of the recorded calls, not of time: a window's times move with the machine's load, its op counts do not.
    calls: dict[str, int] = {}
    for row in windows.last_report.ops:
        calls[row.op_class] = calls.get(row.op_class, 0) + row.calls
    shares = {c: 100 * n / sum(calls.values()) for c, n in calls.items()}
    assert shares.get("other", 0) < 25, sorted(((r.name, r.calls) for r in windows.last_report.ops
                                                if r.op_class == "other"), key=lambda kv: -kv[1])[:10]
    gemms = sum(shares.get(c, 0) for c in ("matmul", "conv", "rnn"))
    assert gemms > 1, shares  # the model's GEMMs are seen as such
    assert windows.last_report.framework_self_us > 0  # the loop's Python time, reported apart from the shares


@pytest.mark.parametrize("name", NAMES)
def test_all_four_together(tmp_path, name):
    model = build(name, faults={"forward": 3})
    case = model.case
    before = snapshot(model)
    policy = PrecisionPolicy(rules={"rnn": "bf16"}, overrides={"model." + case.override: "fp32"},
                             census_every_n_steps=2)
    detector = NaNDetector(action="skip")
    windows = ProfilerWindows(every_n_steps=2, warmup=0, active=1)
    compiler = TorchCompile(modules=["model." + case.blocks], backend="eager")
    probe = StepProbe(steps=[3])
    t = trainer(tmp_path, [policy, detector, windows, compiler, probe], max_steps=5)
    t.fit(model, model.loader())
    assert compiler.watch.frames > 0
    assert compiler.error is None
    assert [(e["step"], e["phase"], e["module"]) for e in detector.events] == [(3, "forward", "model." + case.deep)]
    assert not state_differences(probe.before[3], probe.after[3])
    assert windows.windows_done == 2
    assert ("matmul", "bf16") in policy.census or ("conv", "bf16") in policy.census
    ckpt = os.path.join(tmp_path, "zoo.ckpt")
    t.save_checkpoint(ckpt)
    keys = list(torch.load(ckpt, weights_only=False)["state_dict"])
    assert keys == list(build(name).state_dict())
    assert not any("_orig_mod" in k for k in keys)
    scalars, _ = read_events(str(tmp_path))
    assert {"opkit/nan/skipped_steps", "opkit/profiler/step_time_ms", "opkit/compile/compiles"} <= set(scalars)
    assert snapshot(model) == before


@pytest.mark.parametrize("name", NAMES)
def test_auto_precision_measures_decides_and_leaves_no_trace(tmp_path, name):
    model = build(name)
    before = snapshot(model)
    policy = PrecisionPolicy(rules="auto", census_every_n_steps=1)
    trainer(tmp_path, [policy], max_steps=2).fit(model, model.loader())
    measured, choice = policy.measurements, policy.choice
    assert {"matmul", "conv", "rnn"} & set(measured.classes)
    assert "loss" in measured.classes
    for row in measured:  # every class the model ran was timed, or says why not
        assert row.failed is None, row
        assert row.time_ratio > 0, row
        assert row.fp32_ms > 0, row
        assert row.calls > 0, row
    ran = [r for r in choice.runs if r.ms is not None]
    assert ran[0].name == "fp32"
    assert all(r in ran or "predicted" in (r.skipped or "") for r in choice.runs), choice.runs  # none failed
    for run in ran:  # each table's error (plain autocast's too) measured as a whole against fp32
        assert run.ms > 0, run
        assert run.loss_change < 0.05, run
        assert 0.95 < run.grad_cosine <= 1 + 1e-6, run
    assert choice.best.within(policy.tolerance)
    expected = choice.best.table or dict.fromkeys(measured.classes, "keep")  # plain autocast: all left to it
    assert set(policy.decisions) == set(measured.classes) == set(expected)
    assert all(policy.table[c] == d.dtype == expected[c] for c, d in policy.decisions.items())
    assert all(math.isfinite(v) for v in model.trainer.callback_metrics.values())
    _, texts = read_events(str(tmp_path))
    sensitivity = texts["opkit/precision/sensitivity"][0][1]
    assert "| loss | bf16 |" in sensitivity
    assert "| autocast | plain torch.autocast in bf16" in sensitivity
    assert snapshot(model) == before  # hooks and patches gone
