"""The base every opkit callback shares (core/callback.py): arguments checked, an off callback answering every hook
with nothing, teardown and an exception alike restoring patches and closing the writer (a real Trainer, fitted on a
tiny model). The strategy check before a subclass's own setup: tests/core/test_strategies.py."""

import lightning.pytorch as pl
import pytest
import torch
from helpers import make_loader, trainer
from torch import nn

from lightning_opkit.core.callback import OpkitCallback


class _Probe(OpkitCallback):
    """A minimal opkit callback: patches a model attribute at setup, counts what the base calls."""

    area = "nan"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls: list[str] = []

    def setup(self, trainer, pl_module, stage):
        self.calls.append("setup fit" if stage == "fit" else f"setup {stage}")
        self._open_writer(trainer, stage)
        self._patches.set(pl_module, "probe_marker", True)

    def summary_lines(self):
        return ["probe: ok"]

    def _wind_down(self, trainer, pl_module):
        self.calls.append("wind down")

    def _release(self, trainer, pl_module):
        self.calls.append("release")


class _Model(pl.LightningModule):
    def __init__(self, fail_at=None):
        super().__init__()
        self.net, self.fail_at = nn.Linear(8, 4), fail_at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("boom")
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"_Probe\(enabled='yes'\): expected True or False"):
        _Probe(enabled="yes")
    with pytest.raises(ValueError, match=r"_Probe\(log_dir=''\): expected a directory path or None"):
        _Probe(log_dir="")


def test_teardown_restores_patches_releases_and_closes_the_writer_once(tmp_path):
    probe, model = _Probe(), _Model()
    trainer(tmp_path, [probe], max_steps=2).fit(model, make_loader())
    assert not hasattr(model, "probe_marker")
    assert probe.writer is None
    assert probe.calls == ["setup fit", "wind down", "release"]
    probe._detach()  # again, after teardown: nothing left to undo, nothing fails
    assert probe.calls[-1] == "release"


def test_an_exception_mid_fit_restores_the_model_as_teardown_does(tmp_path):
    probe, model = _Probe(), _Model(fail_at=1)
    with pytest.raises(RuntimeError, match="boom"):
        trainer(tmp_path, [probe], max_steps=4).fit(model, make_loader())
    assert not hasattr(model, "probe_marker")
    assert probe.writer is None
    assert probe.calls[:3] == ["setup fit", "wind down", "release"]


def test_a_callback_that_is_off_answers_every_hook_with_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("OPKIT_DISABLE", "nan")
    probe, model = _Probe(), _Model()
    assert not probe.enabled
    trainer(tmp_path, [probe], max_steps=2).fit(model, make_loader())
    assert probe.calls == []  # its own setup never ran
    assert probe.state_dict() == {}
    assert _Probe(enabled=False).enabled is False
