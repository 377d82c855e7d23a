"""The off switch: each callback's ``enabled`` and the ``OPKIT_DISABLE`` environment variable (core/switch.py)."""

import logging

import lightning.pytorch as pl
import pytest
import torch
from helpers import SaveAt, StepProbe, read_events, snapshot, trainer
from zoo import build

from lightning_opkit import (
    ActivationCheckpointing,
    NaNDetector,
    PrecisionPolicy,
    ProfilerWindows,
    TorchCompile,
)
from lightning_opkit.core.kit import members
from lightning_opkit.core.switch import AREAS, disabled_areas

MAKERS = {
    "precision": lambda **kw: PrecisionPolicy(census_every_n_steps=1, **kw),
    "nan": lambda **kw: NaNDetector(action="skip", **kw),
    "profiler": lambda **kw: ProfilerWindows(every_n_steps=1, warmup=0, active=1, roofline=True, **kw),
    "compile": lambda **kw: TorchCompile(modules="auto", backend="eager", **kw),
    "checkpointing": lambda **kw: ActivationCheckpointing(**kw),
}


class Untouched(pl.Callback):
    """Inside every step: the model as it was before the fit (no hooks, no patched forward, no function mode)."""

    def __init__(self, before):
        self.before, self.seen = before, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(snapshot(pl_module) == self.before)


def _fit(tmp_path, callbacks, steps=3):
    torch.manual_seed(0)
    model = build("torch_encoder")
    probe, untouched = StepProbe(), Untouched(snapshot(model))
    run = trainer(tmp_path, [*callbacks, probe, untouched], max_steps=steps, precision="bf16-mixed")
    run.fit(model, model.loader())
    return run, probe.losses, untouched.seen


def _opkit_tags(tmp_path):
    scalars, texts = read_events(str(tmp_path))
    return [t for t in [*scalars, *texts] if t.startswith("opkit/")]


@pytest.mark.parametrize("how", ["enabled=False", "OPKIT_DISABLE=<area>", "OPKIT_DISABLE=1"])
@pytest.mark.parametrize("area", AREAS)
def test_a_callback_that_is_off_attaches_nothing_and_says_so_once(tmp_path, monkeypatch, caplog, area, how):
    _, plain, _ = _fit(tmp_path / "plain", [])
    if how == "enabled=False":
        callback = MAKERS[area](enabled=False)
    else:
        monkeypatch.setenv("OPKIT_DISABLE", area if how == "OPKIT_DISABLE=<area>" else "1")
        callback = MAKERS[area]()
    assert callback.enabled is False
    with caplog.at_level(logging.INFO):
        run, losses, untouched = _fit(tmp_path / "off", [callback])
    assert losses == plain  # bf16-mixed: a policy that ran would have changed them
    assert untouched == [True, True, True]
    assert members(run) == []
    assert _opkit_tags(tmp_path / "off") == []
    said = [r.getMessage() for r in caplog.records if "attaches nothing" in r.getMessage()]
    reason = "enabled=False" if how == "enabled=False" else how.replace("<area>", area)
    assert said == [f"opkit: {type(callback).__name__} is off ({reason}): it attaches nothing."]
    assert callback.state_dict() == {}


def test_opkit_disable_turns_off_the_areas_it_names_and_no_other(tmp_path, monkeypatch):
    monkeypatch.setenv("OPKIT_DISABLE", "nan, compile")
    callbacks = [NaNDetector(action="skip"), TorchCompile(modules="auto", backend="eager"),
                 ProfilerWindows(every_n_steps=1, warmup=0, active=1)]
    assert [c.enabled for c in callbacks] == [False, False, True]
    run, _, untouched = _fit(tmp_path, callbacks)
    assert members(run) == [callbacks[2]]
    assert callbacks[1].compiled == []  # nothing compiled
    assert untouched == [True, True, True]
    areas = {t.split("/")[1] for t in _opkit_tags(tmp_path)}
    assert "profiler" in areas
    assert not areas & {"nan", "compile"}
    assert callbacks[2].windows_done == 2


@pytest.mark.parametrize("value", ["nan,bogus", "NaNDetector", "2"])
def test_a_bad_opkit_disable_is_refused_at_construction_naming_every_area(monkeypatch, value):
    monkeypatch.setenv("OPKIT_DISABLE", value)
    with pytest.raises(ValueError, match="is no opkit area") as err:
        NaNDetector()
    assert "precision, nan, profiler, compile, checkpointing" in str(err.value)
    assert disabled_areas("0") == disabled_areas("") == frozenset()
    assert disabled_areas("ALL") == frozenset(AREAS)


def test_enabled_must_be_a_bool(tmp_path):
    with pytest.raises(ValueError, match=r"ProfilerWindows\(enabled='no'\): expected True or False"):
        ProfilerWindows(enabled="no")


def test_a_checkpoint_from_a_run_with_a_callback_off_resumes_with_it_on(tmp_path):
    path = tmp_path / "off.ckpt"
    torch.manual_seed(0)
    model = build("torch_encoder")
    trainer(tmp_path / "a", [NaNDetector(action="skip", enabled=False), SaveAt(2, path)],
            max_steps=4).fit(model, model.loader())
    assert not any(k.startswith("NaNDetector") for k in torch.load(path, weights_only=False)["callbacks"])
    torch.manual_seed(0)
    model = build("torch_encoder")
    detector = NaNDetector(action="skip")
    resumed = trainer(tmp_path / "b", [detector], max_steps=4)
    resumed.fit(model, model.loader(), ckpt_path=path)
    assert resumed.global_step == 4  # resumed at step 2 with the detector on, no state of it in the checkpoint
    assert detector.events == []
    assert "opkit/nan/events" in read_events(str(tmp_path / "b"))[0]


def test_enabled_is_configured_from_the_lightning_cli():
    from lightning.pytorch.cli import LightningCLI

    from examples.vit import DigitsDataModule, ViTClassifier

    cli = LightningCLI(ViTClassifier, DigitsDataModule, run=False, save_config_callback=None, args=[
        "--trainer.callbacks+=lightning_opkit.NaNDetector", "--trainer.callbacks.enabled=false",
        "--trainer.callbacks+=lightning_opkit.ProfilerWindows", "--trainer.logger=false"])
    nan, windows = [c for c in cli.trainer.callbacks if type(c).__module__.startswith("lightning_opkit")]
    assert nan.enabled is False
    assert windows.enabled is True
