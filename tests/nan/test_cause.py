"""NaNDetector's cause diagnosis: replays with the culprit in fp32 and as is tell precision from data/model faults."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import make_loader, read_events, snapshot, trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_opkit import NaNDetector, NonFiniteError, PrecisionPolicy
from lightning_opkit.core.replay import rng_state
from lightning_opkit.nan.cause import diagnose
from lightning_opkit.nan.report import Origin


class Net(pl.LightningModule):
    """``big`` overflows fp16 (outputs ~1e6) but not fp32; ``fault`` is a module-made NaN at ``fault_step``."""

    def __init__(self, big_scale: float = 1.0, fault_step: int = -1, fault_calls: int = 10**9):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.big = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.big.weight.mul_(big_scale)
        self.fault_step, self.fault_calls, self.calls = fault_step, fault_calls, 0

    def forward(self, x):
        h = self.inp(x)
        if self.global_step == self.fault_step and self.training:
            self.calls += 1
            if self.calls <= self.fault_calls:  # the model's own fault: NaN on its first `fault_calls` runs
                h = h + torch.log(-torch.ones_like(h[:1]))
        h = self.big(h) * 1e-6
        return self.head(h.float())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fp16():
    return [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]


@pytest.mark.parametrize("lowered_by", ["policy", "autocast"])
def test_fp16_overflow_is_a_precision_cause_with_the_fix_named(tmp_path, lowered_by):
    model = Net(big_scale=3e5)  # |big(h)| ~ 1e5..1e6: inf in fp16, fine in fp32
    before = snapshot(model)
    callbacks = [NaNDetector(action="raise")]
    if lowered_by == "policy":
        callbacks.append(PrecisionPolicy(rules={"matmul": "fp32"}, overrides={"big": "fp16"}, measure=False))
    with pytest.raises(NonFiniteError) as info:
        trainer(tmp_path, callbacks, max_steps=2, plugins=_fp16()).fit(model, make_loader())
    report = info.value.report
    assert (report["module"], report["phase"], report["cause"]) == ("big", "forward", "precision")
    assert "PrecisionPolicy(overrides={'big': 'fp32'})" in str(info.value)
    assert snapshot(model) == before  # the extra replays left nothing behind
    _, texts = read_events(str(tmp_path))
    assert "precision" in texts["opkit/nan/cause"][0][1]
    assert "'big'" in texts["opkit/nan/cause"][0][1]
    assert "| cause | precision |" in texts["opkit/nan/report"][0][1]


def test_an_overflow_that_is_fine_in_fp32_trains_in_fp32():
    # the control: the same model without 16-bit anything is finite, so the precision verdict above is not vacuous
    model = Net(big_scale=3e5)
    x, y = next(iter(make_loader()))
    assert torch.isfinite(model.training_step((x, y), 0))
    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(model.big(model.inp(x))).all()


def test_a_model_nan_is_data_or_model(tmp_path):
    detector = NaNDetector(action="skip")
    policy = PrecisionPolicy(census_every_n_steps=0, measure=False)
    trainer(tmp_path, [detector, policy], max_steps=3).fit(Net(fault_step=1), make_loader())
    (report,) = detector.events
    assert (report["module"], report["phase"], report["cause"]) == ("", "forward", "data_or_model")
    assert "fp32 too" in report["advice"]


@pytest.mark.parametrize("fault_calls", [1, 2])
def test_a_nan_that_does_not_come_back_is_transient(tmp_path, fault_calls):
    # 1: only the step itself saw it (the localization replay did not); 2: the localization replay saw it too, the
    # fp32 and the as-is replays did not
    detector = NaNDetector(action="skip")
    trainer(tmp_path, [detector], max_steps=3).fit(Net(fault_step=1, fault_calls=fault_calls), make_loader())
    (report,) = detector.events
    assert report["cause"] == "transient"
    assert (report["module"] is None) == (fault_calls == 1)


def test_a_nan_in_the_data_is_data_or_model(tmp_path):
    loader = make_loader()
    x, y = loader.dataset.tensors
    x = x.clone()
    x[8, 3] = float("nan")  # the second batch (batch_size 8) carries a NaN
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    detector = NaNDetector(action="skip")
    trainer(tmp_path, [detector], max_steps=3, precision="bf16-mixed").fit(Net(), loader)
    (report,) = detector.events
    assert report["step"] == 1
    assert report["cause"] == "data_or_model"
    assert "batch 1" in report["advice"]


class Boom(nn.Module):
    """Scales its input past fp16's range (65504): inf in fp16, finite in fp32."""

    def forward(self, x):
        return x * 1e5


class SixteenTrue(pl.LightningModule):
    """A model trained with ``precision="16-true"``: fp16 weights everywhere, a LayerNorm after the overflow."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.boom = Boom()
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.ln(self.boom(self.inp(x))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_an_fp16_overflow_under_16_true_is_a_precision_cause(tmp_path):
    # The fp32 replay of `boom` must run next to fp16 weights: its output goes on to the fp16 LayerNorm in fp16.
    model = SixteenTrue()
    with pytest.raises(NonFiniteError) as info:
        trainer(tmp_path, [NaNDetector(action="raise")], max_steps=2, precision="16-true").fit(model, make_loader())
    report = info.value.report
    assert (report["module"], report["phase"], report["dtype"]) == ("boom", "forward", "float16")
    assert report["cause"] == "precision", report["advice"]
    assert "PrecisionPolicy(overrides={'boom': 'fp32'})" in report["advice"]
    assert {p.dtype for p in model.parameters()} == {torch.float16}


class FailsInReplay(Net):
    """The model NaN of ``Net``, and a step that raises from its third run on (the first cause replay)."""

    def forward(self, x):
        if self.global_step == self.fault_step and self.training and self.calls >= 2:
            raise RuntimeError("this step cannot be replayed")
        return super().forward(x)


def test_a_cause_replay_that_fails_gives_an_unknown_cause_with_the_reason(tmp_path):
    detector = NaNDetector(action="skip")
    with pytest.warns(UserWarning, match="a cause replay failed"):
        trainer(tmp_path, [detector], max_steps=3).fit(FailsInReplay(fault_step=1), make_loader())
    (report,) = detector.events
    assert report["cause"] == "unknown"
    assert "RuntimeError: this step cannot be replayed" in report["advice"]
    assert "not observed" in report["advice"]


class _Overflows(nn.Module):
    """``(300 x)^2``: 90000 at x = 1, past fp16's 65504, finite in fp32."""

    def forward(self, x):
        return (300 * x) ** 2


class _LogOfNegative(nn.Module):
    def forward(self, x):
        return torch.log(-x.abs() - 1)


@pytest.mark.parametrize("culprit, cause", [(_Overflows, "precision"), (_LogOfNegative, "data_or_model")])
def test_diagnose_without_a_trainer_tells_precision_from_data_or_model(culprit, cause):
    model = nn.Sequential(culprit(), nn.Linear(4, 1)).half()
    x = torch.ones(2, 4, dtype=torch.half)
    found = Origin(phase="forward", module="0")
    got = diagnose(lambda autocast: lambda: model(x).float().sum(), model, rng_state(), found,
                   dict(model.named_modules()), policies=[], batch_idx=7)
    assert got.cause == cause
    assert ("PrecisionPolicy(overrides={'0': 'fp32'})" in got.advice) == (cause == "precision")
    assert ("batch 7" in got.advice) == (cause == "data_or_model")
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # the fp32 run undone
    assert model[1].weight.dtype == torch.half


def test_a_whole_step_with_16_bit_weights_is_replayed_on_fp32_copies_as_a_spike_s_is():
    # the one replay NaN faults and spikes share (replay_in): with no culprit module, every top module in fp32
    model = nn.Sequential(_Overflows(), nn.Linear(4, 1)).half()
    x = torch.ones(2, 4, dtype=torch.half)
    got = diagnose(lambda autocast: lambda: model(x).float().sum(), model, rng_state(),
                   Origin(phase="loss", module=""), dict(model.named_modules()), policies=[], batch_idx=0)
    assert got.cause == "precision"
    assert "precision='32-true'" in got.advice
    assert model[1].weight.dtype == torch.half
