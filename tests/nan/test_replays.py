"""The slow path's replays (nan/replays.py), driven directly from inside a real fit (no NaNDetector attached): a step
whose module goes non-finite is named at that module with its cause; a fault only in backward is no forward fault; a
step that was healthy is not reproduced; the model is as it was after each replay."""

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import make_loader, read_events, snapshot, trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_opkit import NaNDetector, NonFiniteError, PrecisionPolicy, TorchCompile
from lightning_opkit.core.replay import rng_state
from lightning_opkit.nan.replays import MicroBatch, Replays, diagnose, locate
from lightning_opkit.nan.report import Origin


class _Poison(nn.Module):
    """Multiplies by inf in forward (``where="forward"``) or in backward (``"backward"``) on batch ``at``."""

    def __init__(self, where):
        super().__init__()
        self.where, self.batch = where, -1

    def forward(self, x):
        if self.batch != 2:
            return x
        if self.where == "forward":
            return x * float("inf")
        return _InfGrad.apply(x)


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class _Model(pl.LightningModule):
    def __init__(self, where):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.poison = _Poison(where)
        self.head = nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):
        self.poison.batch = batch_idx
        return nn.functional.cross_entropy(self.head(self.poison(self.net(batch[0]))), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Drive(pl.Callback):
    """Replays batch 1 (healthy) and batch 2 (poisoned) as NaNDetector would, and keeps what they said."""

    def __init__(self):
        self.found: dict[int, tuple] = {}
        self.pending: list[MicroBatch] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.pending = [MicroBatch(batch, batch_idx, rng_state())]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step not in (1, 2):
            return
        replays = Replays(forward=True, backward=True, loss=True)
        replays.hooked = list(pl_module.named_modules())
        replays.join(trainer)
        before = snapshot(pl_module)
        report = replays.report(trainer, pl_module, self.pending, loss_bad=False, optimizer=optimizer)
        fault = replays.forward_fault(trainer, pl_module, self.pending)
        after = snapshot(pl_module)
        self.found[trainer.global_step] = (report, fault, before == after)
        for p in pl_module.parameters():  # the run goes on: the poisoned step changes nothing
            p.grad = None


def _run(tmp_path, where):
    drive = _Drive()
    trainer(tmp_path, [drive], max_steps=3).fit(_Model(where), make_loader())
    return drive.found


def test_a_forward_fault_is_named_at_its_module_with_its_cause(tmp_path):
    found = _run(tmp_path, "forward")
    report, fault, untouched = found[2]
    assert (report.origin.phase, report.origin.module, report.origin.module_type) == ("forward", "poison", "_Poison")
    assert report.origin.inf > 0
    assert report.cause is not None
    assert report.cause.cause == "data_or_model"  # inf in fp32 too: no precision to blame
    assert (report.step, report.batch_idx) == (2, 2)
    assert fault
    assert untouched
    healthy, fault, untouched = found[1]
    assert healthy.origin.module is None  # nothing to reproduce
    assert healthy.cause.cause == "transient"
    assert not fault
    assert untouched


def test_a_backward_only_fault_is_no_forward_fault(tmp_path):
    report, fault, untouched = _run(tmp_path, "backward")[2]
    # the gradient of poison's input went non-finite in its backward, while the gradient it received was finite
    assert (report.origin.phase, report.origin.module) == ("backward", "poison")
    assert report.origin.inf == 8 * 16  # every element of its input's gradient: a batch of 8 by 16 features
    assert report.origin.input_absmax is not None
    assert not fault
    assert untouched


def test_the_kit_is_found_at_setup_and_what_it_compiled_is_read_at_the_fault():
    replays = Replays(forward=True, backward=True, loss=True)
    replays.join(pl.Trainer(logger=False, enable_progress_bar=False, callbacks=[]))
    assert (replays.policies, replays.compilers, replays.ran_compiled) == ([], [], False)
    compiler, policy = TorchCompile(backend="eager"), PrecisionPolicy(rules={"matmul": "bf16"})
    replays.join(pl.Trainer(logger=False, enable_progress_bar=False, callbacks=[NaNDetector(), compiler, policy]))
    assert replays.policies == [policy]
    assert replays.compilers == [compiler]
    assert not replays.ran_compiled  # nothing compiled yet
    compiler.compiled.append("body")  # as setup records a region it compiled
    assert replays.ran_compiled


# Localization (locate, nan/replays.py) without a Trainer: one replay with hooks names where the first non-finite
# value came from (a forward output from finite inputs, a backward input-gradient, the loss), and leaves nothing hooked.


class LogOf(nn.Module):
    """``log(x - shift)``: NaN where ``x < shift``, finite elsewhere."""

    def __init__(self, shift):
        super().__init__()
        self.shift = shift

    def forward(self, x):
        return torch.log(x - self.shift)


class SqrtOfZero(nn.Module):
    """``sqrt(0 * x)``: finite forward (zeros), non-finite backward (0 * inf)."""

    def forward(self, x):
        return torch.sqrt(x * 0)


def _locate(model, loss=lambda out: out.sum(), **kw):
    x = torch.ones(2, 4)
    flags = dict(forward=True, backward=True, loss=True) | kw
    return locate(model, lambda: loss(model(x)), rng_state(), modules=list(model.named_modules()), **flags)


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def test_the_first_module_whose_output_went_non_finite_is_named_not_the_ones_after():
    model = nn.Sequential(nn.Linear(4, 4), LogOf(shift=100.0), nn.Linear(4, 1))
    origin = _locate(model)
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "1", "LogOf")
    assert origin.nan == 8
    assert origin.inf == 0  # every element of its (2, 4) output
    assert _hooks(model) == 0


def test_a_backward_that_makes_an_input_gradient_non_finite_is_named_with_phase_backward():
    model = nn.Sequential(nn.Linear(4, 4), SqrtOfZero(), nn.Linear(4, 1))
    origin = _locate(model)
    assert (origin.phase, origin.module) == ("backward", "1")
    assert _locate(model, backward=False) is None  # the forward is finite: without backward, nothing to name
    assert _hooks(model) == 0


def test_a_loss_that_goes_non_finite_from_a_finite_forward_is_the_loss():
    model = nn.Sequential(nn.Linear(4, 1))
    origin = _locate(model, loss=lambda out: torch.log(-out.abs().sum() - 1))
    assert (origin.phase, origin.module, origin.op_class) == ("loss", "", "loss")


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_a_finite_step_names_nothing_and_the_rng_is_replayed_from_the_given_state(dropout):
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(dropout), nn.Linear(4, 1))
    state = rng_state()
    seen = []
    assert locate(model, lambda: seen.append(torch.rand(1)) or model(torch.ones(2, 4)).sum(), state,
                  modules=list(model.named_modules()), forward=True, backward=True, loss=True) is None
    assert seen
    assert all(torch.equal(s, seen[0]) for s in seen)  # every replay drew the same numbers


# NaNDetector's cause diagnosis: replays with the culprit in fp32 and as is tell precision from data/model faults.


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
