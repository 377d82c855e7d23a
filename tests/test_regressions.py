"""One test per defect found by trying the callbacks on models nobody here wrote (issue 9), each named after it.

Each failed before its fix. Several run on the zoo (tests/zoo); test_zoo.py checks every callback on every model.
"""

import gc
import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    REFUSED,
    StepProbe,
    TinyNet,
    make_loader,
    policy_refused_under,
    read_events,
    state_differences,
    trainer,
)
from zoo import build

from lightning_opkit import NaNDetector, PrecisionPolicy, ProfilerWindows, TorchCompile

# TorchCompile


@pytest.mark.parametrize("name, glob", [("torch_encoder", "model.encoder.layers.*"), ("torch_mha", "model.head"),
                                        ("torch_lstm", "model.head")])
def test_d01_regional_compile_of_torch_nn_builtin_modules_really_compiles(tmp_path, name, glob):
    # torch 2.13 converts no frame for a compiled ``_call_impl`` of torch.nn's own modules
    model = build(name)
    compiler = TorchCompile(modules=[glob], backend="eager")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer(tmp_path, [compiler], max_steps=2).fit(model, model.loader())
    assert compiler.watch.frames > 0
    assert compiler.watch.graphs > 0
    assert compiler.error is None
    assert not [w for w in record if "TorchCompile" in str(w.message)]  # no "nothing was compiled" warning


def test_d03_a_users_own_error_is_not_a_compile_failure(tmp_path):
    calls = []

    class ShapeBug(TinyNet):
        def forward(self, x):
            calls.append(1)
            return self.head(x)  # 8 features into a Linear(16, 4)

    compiler = TorchCompile(backend="eager")  # fallback=True
    with pytest.raises(Exception, match="same reduction dim|shapes cannot be multiplied") as err:
        trainer(tmp_path, [compiler], max_steps=1).fit(ShapeBug(), make_loader())
    assert not isinstance(err.value, torch._dynamo.exc.BackendCompilerFailed)
    assert compiler.error is None
    assert len(calls) < 2
    scalars, _ = read_events(str(tmp_path))
    assert "opkit/compile/eager_fallback" not in scalars


@pytest.mark.parametrize("kwargs, match", [
    (dict(options={"max_autotune": "yes"}), r"options\['max_autotune'\].*'yes'.*bool"),
    (dict(options={"compile_threads": 1.5}), r"compile_threads.*int"),
    (dict(backend="eager", options={"max_autotune": True}), r"inductor backend only.*'eager'"),
    (dict(modules=[]), "empty list"),
])
def test_d03_option_values_are_checked_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TorchCompile(**kwargs)


# PrecisionPolicy


@pytest.mark.parametrize("name", ["torch_mha", "torch_encoder", "torch_lstm"])
def test_d04_policy_mode_gives_right_values_around_compiled_builtin_modules(tmp_path, name):
    losses = {}
    for backend in (None, "eager"):
        model = build(name)
        probe = StepProbe()
        compiler = [TorchCompile(modules=["model." + model.case.blocks], backend=backend)] if backend else []
        trainer(tmp_path / str(backend), [PrecisionPolicy(census_every_n_steps=0), *compiler, probe],
                max_steps=3).fit(model, model.loader())
        losses[backend] = probe.losses
    assert losses["eager"] == losses[None]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_d05_module_overrides_hold_on_every_backend(tmp_path, backend):
    losses = {}
    for compiled in (False, True):
        model = build("hf_gpt2")
        probe = StepProbe()
        policy = PrecisionPolicy(overrides={"model.lm_head": "fp32", "model.transformer.h.1.mlp": "fp32"},
                                 census_every_n_steps=0)
        compiler = [TorchCompile(modules=["model.transformer.h.*"], backend=backend)] if compiled else []
        run = trainer(tmp_path / str(compiled), [policy, *compiler, probe], max_steps=3)
        if compiled and policy_refused_under(backend):
            with pytest.raises(ValueError, match=REFUSED):
                run.fit(model, model.loader())
            return
        run.fit(model, model.loader())
        losses[compiled] = probe.losses
    assert losses[True] == losses[False]


def test_d06_policy_leaves_autocast_off_where_the_user_turned_it_off(tmp_path):
    seen = {}

    class Region(TinyNet):
        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                h = F.relu(self.body[0](x))  # a governed op (activation) ...
                out = self.head(h)  # ... then an op the policy keeps: the user's fp32 region
            seen["out"] = out.dtype
            return out

    policy = PrecisionPolicy(rules={"matmul": "keep", "activation": "fp32"}, census_every_n_steps=0)
    trainer(tmp_path, [policy], max_steps=1, precision="bf16-mixed").fit(Region(), make_loader())
    assert seen["out"] == torch.float32


@pytest.mark.parametrize("kwargs, precision", [
    (dict(rules={"norm": "bf16"}), "32-true"),
    (dict(overrides={"model.layers.*": "bf16"}), "32-true"),
    (dict(), "bf16-true"),
])
def test_d07_batchnorm_running_stats_update_under_any_cast(tmp_path, kwargs, precision):
    model = build("bn_cnn")
    start = {n: b.clone() for n, b in model.named_buffers() if b.is_floating_point()}
    trainer(tmp_path, [PrecisionPolicy(census_every_n_steps=0, **kwargs)], max_steps=2,
            precision=precision).fit(model, model.loader())
    stale = [n for n, b in model.named_buffers() if b.is_floating_point() and torch.equal(b.to(start[n].dtype),
                                                                                          start[n])]
    assert len(start) == 10
    assert not stale


@pytest.mark.parametrize("kwargs, match", [
    (dict(rules="matmul"), r"Expected `rules` to be 'auto', a dict.*'matmul'"),
    (dict(rules={"matmul": ["bf16"]}), r"`rules\['matmul'\]` is \['bf16'\]; expected one of"),
    (dict(rules={"other": "bf16"}), r"cannot set op class 'other'.*never casts"),
    (dict(overrides=["head"]), r"Expected `overrides` to be a dict"),
    (dict(overrides={"head": ["fp32"]}), r"`overrides\['head'\]`"),
])
def test_d08_bad_types_give_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrecisionPolicy(**kwargs)


# NaNDetector


def test_d09_skip_leaves_batchnorm_statistics_as_they_were(tmp_path):
    model = build("bn_cnn", faults={"forward": 2})
    probe = StepProbe(steps=[2])
    trainer(tmp_path, [NaNDetector(action="skip"), probe], max_steps=4).fit(model, model.loader())
    assert not state_differences(probe.before[2], probe.after[2])
    assert all(torch.isfinite(b.float()).all() for b in model.buffers())
    model.eval()
    assert torch.isfinite(model(next(iter(model.loader())))).all()


def test_d09_a_raise_leaves_batchnorm_statistics_as_they_were_too(tmp_path):
    from lightning_opkit import NonFiniteError

    model = build("bn_cnn", faults={"forward": 1})
    probe = StepProbe(steps=[1])
    with pytest.raises(NonFiniteError):
        trainer(tmp_path, [NaNDetector(action="raise"), probe], max_steps=3).fit(model, model.loader())
    before = probe.before[1]
    assert all(torch.equal(b, before["buffers"][n]) for n, b in model.named_buffers())
    assert all(torch.equal(p, before["params"][n]) for n, p in model.named_parameters())


def test_d10_a_causal_minus_inf_mask_does_not_hide_the_culprit(tmp_path):
    model = build("torch_encoder", faults={"forward": 1}, deep="encoder.layers.1.self_attn")
    detector = NaNDetector(action="skip")
    trainer(tmp_path, [detector], max_steps=2).fit(model, model.loader())
    (event,) = detector.events
    assert (event["module"], event["module_type"], event["op_class"]) == (
        "model.encoder.layers.1.self_attn", "MultiheadAttention", "attention")


class DecayEverything(torch.optim.Optimizer):
    """Decays every parameter, with or without a gradient: relying on ``grad=None`` cannot skip its step."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(0.9)
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss


@pytest.mark.parametrize("clip", ["value", "norm"])
def test_d11_skip_leaves_out_the_optimizer_step_whatever_the_optimizer_and_clipping(tmp_path, clip):
    class Net(TinyNet):
        def configure_optimizers(self):
            return DecayEverything(self.parameters())

    model = Net(forward_steps=(2,))
    probe = StepProbe(steps=[2])
    trainer(tmp_path, [NaNDetector(action="skip"), probe], max_steps=4, gradient_clip_val=0.5,
            gradient_clip_algorithm=clip).fit(model, make_loader())
    assert not state_differences(probe.before[2], probe.after[2])
    assert model.global_step == 4
    moved = StepProbe(steps=[3])  # a step that is not skipped does move every weight (decay): the probe can tell
    trainer(tmp_path / "clean", [NaNDetector(action="skip"), moved], max_steps=4).fit(Net(), make_loader())
    assert state_differences(moved.before[3], moved.after[3])


@pytest.mark.parametrize("name, deep, op_class", [("hf_gpt2", "transformer.h.1.mlp.c_fc", "matmul"),
                                                   ("hf_llama", "model.layers.1.input_layernorm", "norm")])
def test_d12_report_classifies_modules_by_what_they_run(tmp_path, name, deep, op_class):
    model = build(name, faults={"forward": 1}, deep=deep)
    detector = NaNDetector(action="skip")
    trainer(tmp_path, [detector], max_steps=2).fit(model, model.loader())
    (event,) = detector.events
    assert (event["module"], event["op_class"]) == ("model." + deep, op_class)


# ProfilerWindows


def test_d13_finished_windows_are_freed_without_a_garbage_collection(tmp_path):
    gc.collect()
    gc.disable()
    try:
        windows = ProfilerWindows(every_n_steps=2, warmup=0, active=1, export_trace=False)
        trainer(tmp_path, [windows], max_steps=12).fit(TinyNet(), make_loader(n=128))
        alive = [o for o in gc.get_objects() if isinstance(o, torch.profiler.profile)]
    finally:
        gc.enable()
    assert windows.windows_done == 5
    assert alive == []


def test_d14_a_trace_export_failure_warns_and_training_goes_on(tmp_path):
    log_dir = tmp_path / "lightning_logs" / "version_0"
    log_dir.mkdir(parents=True)
    (log_dir / "traces").write_text("a file where the trace folder should be")
    windows = ProfilerWindows(every_n_steps=2, warmup=0, active=1)
    with pytest.warns(UserWarning, match="could not write the trace.*training goes on"):
        trainer(tmp_path, [windows], max_steps=6, logger=pl.loggers.TensorBoardLogger(str(tmp_path), version=0)).fit(
            TinyNet(), make_loader())
    assert windows.export_errors == 2
    assert windows.windows_done == 2
    assert windows.trace_files == []
    scalars, _ = read_events(str(tmp_path))
    assert scalars["opkit/profiler/export_errors"] == [(3, 1.0), (5, 2.0)]
    assert scalars["opkit/profiler/step_time_ms"][-1][0] == 5


def test_d15_a_second_fit_starts_its_schedule_afresh(tmp_path):
    windows = ProfilerWindows(every_n_steps=3, warmup=0, active=1, keep_traces=1)
    trainer(tmp_path / "a", [windows], max_steps=4).fit(TinyNet(), make_loader())
    first = list(windows.trace_files)
    trainer(tmp_path / "b", [windows], max_steps=4).fit(TinyNet(), make_loader())
    assert [os.path.basename(p) for p in windows.trace_files] == [os.path.basename(p) for p in first]
    assert windows.trace_files != first
    assert all(os.path.exists(p) for p in first + windows.trace_files)


@pytest.mark.parametrize("kwargs, match", [
    (dict(gzip="yes"), "`gzip` to be a bool"),
    (dict(record_shapes=None), "`record_shapes` to be a bool"),
    (dict(all_ranks=1), "`all_ranks` to be a bool"),
])
def test_d16_profiler_bools_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ProfilerWindows(**kwargs)


def test_d16_empty_module_lists_are_refused():
    for cls in (NaNDetector, TorchCompile):
        with pytest.raises(ValueError, match="`modules` is an empty list"):
            cls(modules=[])


def test_d17_policy_governs_lstms(tmp_path):
    model = build("torch_lstm")
    seen = []
    model.model.blocks[1].lstm.register_forward_hook(lambda m, a, out: seen.append(out[0].dtype))
    policy = PrecisionPolicy(rules={"rnn": "bf16"}, census_every_n_steps=1)  # the speed check runs no extra forward
    trainer(tmp_path, [policy], max_steps=1).fit(model, model.loader())
    assert seen == [torch.bfloat16]
    assert policy.measurements.get("rnn", "bf16").time_ratio > 0  # timed from the ops the step itself ran
