"""One vocabulary across the callbacks (docs/arguments.md): ``modules``, ``measure``, ``..._every_n_steps=0`` = off,
and the old spellings, which work for one release and warn naming the new one."""

import inspect
import logging
import warnings

import pytest
import torch
from helpers import StepProbe, read_events, trainer
from zoo import build

from lightning_opkit import (
    ActivationCheckpointing,
    NaNDetector,
    OpkitDeprecationWarning,
    PrecisionPolicy,
    ProfilerWindows,
    TorchCompile,
)
from lightning_opkit.core.checks import check_globs
from lightning_opkit.core.kit import members

CALLBACKS = [ActivationCheckpointing, NaNDetector, PrecisionPolicy, ProfilerWindows, TorchCompile]

#: old spelling -> (the callback, the new argument, the value passed, the attribute that holds it)
RENAMED = {
    "modules": (PrecisionPolicy, "overrides", {"head": "fp32"}),
    "measure_every_n_steps": (PrecisionPolicy, "remeasure_every_n_steps", 5),
    "check_speed": (PrecisionPolicy, "measure", False),
    "measure_speedup": (TorchCompile, "measure", True),
    "memory": (ProfilerWindows, "memory_breakdown", True),
}
DEPRECATED = {(cls, old) for old, (cls, _, _) in RENAMED.items()}


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_an_old_spelling_works_and_warns_naming_the_new_one(old):
    cls, new, value = RENAMED[old]
    with pytest.warns(OpkitDeprecationWarning, match=rf"{cls.__name__}\({old}=\.\.\.\) is deprecated.*use {new}="):
        callback = cls(**{old: value})
    assert getattr(callback, new) == value
    assert getattr(callback, new) == getattr(cls(**{new: value}), new)  # the same as the new spelling


@pytest.mark.parametrize("old", ["modules", "measure_every_n_steps"])
def test_both_spellings_with_different_values_are_refused(old):
    cls, new, value = RENAMED[old]
    other = {"modules": {"tail": "fp32"}, "measure_every_n_steps": 7}[old]
    with pytest.raises(ValueError, match=rf"`{old}` is the old name of `{new}`; pass only `{new}`"):
        cls(**{old: value, new: other})
    with pytest.raises(ValueError, match="`memory` is the old name of `memory_breakdown`"):
        ProfilerWindows(memory=False, memory_breakdown=True)


def test_the_old_measure_speedup_false_still_measured_as_eager_if_slower_did():
    with pytest.warns(OpkitDeprecationWarning):
        compiler = TorchCompile(measure_speedup=False)
    assert compiler.measure is True  # eager_if_slower (on by default) timed each region whatever the flag said
    with pytest.warns(OpkitDeprecationWarning):
        assert TorchCompile(measure_speedup=False, eager_if_slower=False).measure is False


def test_keep_traces_zero_keeps_every_trace_for_one_more_release():
    with pytest.warns(OpkitDeprecationWarning, match="keep_traces=None"):
        windows = ProfilerWindows(keep_traces=0)
    assert windows.keep_traces is None
    assert ProfilerWindows(keep_traces=2).keep_traces == 2


@pytest.mark.parametrize("cls", CALLBACKS)
def test_every_argument_that_measures_before_deciding_is_called_measure(cls):
    params = inspect.signature(cls).parameters
    current = [n for n in params if (cls, n) not in DEPRECATED]
    assert not [n for n in current if n.startswith("check_speed") or "speedup" in n]
    if cls in (PrecisionPolicy, TorchCompile, ActivationCheckpointing):
        assert params["measure"].annotation in (bool, "bool")
    for old in (n for n in params if (cls, n) in DEPRECATED):  # old spellings are keyword-only in spirit: last
        assert list(params).index(old) > list(params).index("log_dir")


@pytest.mark.parametrize("cls", [ActivationCheckpointing, NaNDetector, TorchCompile])
def test_modules_selects_where_a_callback_acts_and_an_empty_list_is_refused_alike(cls):
    assert inspect.signature(cls).parameters["modules"].default is None  # None = the callback's documented default
    with pytest.raises(ValueError, match=r"^`modules` is an empty list, which would match no module; use None"):
        cls(modules=[])
    with pytest.raises(ValueError, match=r"^Expected `modules` to be a list of glob strings"):
        cls(modules="blocks.*")


def test_activation_checkpointing_modules_none_is_auto():
    assert ActivationCheckpointing().modules == "auto" == ActivationCheckpointing(modules="auto").modules


@pytest.mark.parametrize("cls", CALLBACKS)
def test_zero_means_off_for_every_every_n_steps_argument(cls):
    for name in inspect.signature(cls).parameters:
        if name.endswith("every_n_steps") and (cls, name) not in DEPRECATED:
            cls(**{name: 0})  # accepted
            with pytest.raises(ValueError, match=rf"`{name}`.*-1"):
                cls(**{name: -1})


@pytest.mark.parametrize("cls", [NaNDetector, ProfilerWindows])
def test_a_callback_whose_every_n_steps_is_zero_attaches_nothing_and_says_why(tmp_path, caplog, cls):
    callback = cls(every_n_steps=0)
    assert callback.enabled is False
    torch.manual_seed(0)
    model = build("torch_encoder")
    probe = StepProbe()
    with caplog.at_level(logging.INFO):
        run = trainer(tmp_path, [callback, probe], max_steps=2)
        run.fit(model, model.loader())
    assert len(probe.losses) == 2
    assert members(run) == []
    assert not [t for t in [*read_events(str(tmp_path))[0]] if t.startswith("opkit/")]
    said = [r.getMessage() for r in caplog.records if "attaches nothing" in r.getMessage()]
    assert said == [f"opkit: {cls.__name__} is off (every_n_steps=0): it attaches nothing."]


def test_save_is_checked_item_by_item_naming_the_valid_classes():
    with pytest.raises(ValueError, match=r"Expected `save` to list items of \[.*'matmul'.*\], but got 'gemm'"):
        ActivationCheckpointing(save=["matmul", "gemm"])


def test_the_new_names_parse_from_a_lightningcli_config(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    from examples.vit import DigitsDataModule, ViTClassifier

    config = tmp_path / "config.yaml"
    config.write_text("""
trainer:
  logger: false
  callbacks:
    - class_path: lightning_opkit.PrecisionPolicy
      init_args: {overrides: {model.head: fp32}, remeasure_every_n_steps: 0, measure: false}
    - class_path: lightning_opkit.TorchCompile
      init_args: {modules: auto, backend: eager, measure: false}
    - class_path: lightning_opkit.NaNDetector
      init_args: {every_n_steps: 0}
""")
    cli = LightningCLI(ViTClassifier, DigitsDataModule, run=False, save_config_callback=None,
                       args=["--config", str(config)])
    policy, compiler, detector = [c for c in cli.trainer.callbacks if type(c).__module__.startswith("lightning_opkit")]
    assert (policy.overrides, policy.remeasure_every_n_steps, policy.measure) == ({"model.head": "fp32"}, 0, False)
    assert (compiler.modules, compiler.measure) == ("auto", False)
    assert detector.enabled is False


@pytest.mark.parametrize(
    "value, message",
    [([], "`modules` is an empty list, which would match no module; use None for the default"),
     ("blocks.*", "Expected `modules` to be a list of glob strings, 'auto' or None, but got 'blocks.*'"),
     (["blocks.*", 3], "Expected `modules` to be a list of glob strings, 'auto' or None, but got ['blocks.*', 3]")],
)
def test_one_helper_words_a_bad_modules_alike_for_every_callback(value, message):
    with pytest.raises(ValueError, match="modules") as caught:
        check_globs("modules", value, ("auto",))
    assert str(caught.value) == message
    for cls in (TorchCompile, ActivationCheckpointing):  # the two that take "auto": the very same words
        with pytest.raises(ValueError, match="modules") as again:
            cls(modules=value)
        assert str(again.value) == message
    assert check_globs("modules", None) is None
    assert check_globs("modules", "auto", ("auto",)) is None


def test_measurement_speed_reads_on_as_time_ratio_for_one_release():
    from lightning_opkit import Measurement

    row = Measurement("matmul", "bf16", time_ratio=2.5)
    with pytest.warns(OpkitDeprecationWarning, match=r"Measurement.speed is deprecated.*Measurement.time_ratio"):
        assert row.speed == 2.5


def test_both_spellings_with_the_new_at_its_default_take_the_old_value_with_the_warning_as_documented():
    # docs/arguments.md: the new name at its default cannot be told from not passing it
    with pytest.warns(OpkitDeprecationWarning, match=r"check_speed=\.\.\.\) is deprecated"):
        assert PrecisionPolicy(check_speed=False, measure=True).measure is False
    with pytest.raises(ValueError, match=r"check_speed=True, measure=False"):
        PrecisionPolicy(check_speed=True, measure=False)


def test_trial_steps_is_one_name_on_both_callbacks_and_the_old_names_parse_with_a_warning(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    from examples.vit import DigitsDataModule, ViTClassifier

    def parsed(policy_args: str, checkpointing_args: str):
        config = tmp_path / "config.yaml"
        config.write_text(f"""
trainer:
  logger: false
  callbacks:
    - class_path: lightning_opkit.PrecisionPolicy
      init_args: {{rules: auto, {policy_args}}}
    - class_path: lightning_opkit.ActivationCheckpointing
      init_args: {{measure: true, {checkpointing_args}}}
""")
        cli = LightningCLI(ViTClassifier, DigitsDataModule, run=False, save_config_callback=None,
                           args=["--config", str(config)])
        return [c for c in cli.trainer.callbacks if type(c).__module__.startswith("lightning_opkit")]

    with warnings.catch_warnings():
        warnings.simplefilter("error", OpkitDeprecationWarning)
        policy, checkpointing = parsed("trial_steps: 0", "trial_steps: 5")
    assert (policy.trial_steps, checkpointing.trial_steps) == (0, 5)
    with pytest.warns(OpkitDeprecationWarning) as caught:
        policy, checkpointing = parsed("trial_rounds: 4", "measure_steps: 2")
    assert (policy.trial_steps, checkpointing.trial_steps) == (4, 2)
    said = " ".join(str(w.message) for w in caught)
    assert "PrecisionPolicy(trial_rounds=...)" in said
    assert "ActivationCheckpointing(measure_steps=...)" in said
    with pytest.raises(ValueError, match=r"measure_steps=2, trial_steps=4"):
        ActivationCheckpointing(measure_steps=2, trial_steps=4)
    with pytest.raises(ValueError, match=r"Expected `trial_steps`"):
        ActivationCheckpointing(trial_steps=0)
