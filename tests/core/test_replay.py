"""Run a training step again without a trace (core/replay.py): buffers, metric states, RNG and .grad put back, logging
silenced, the replay's scope visible to the user's code."""

import copy
import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from helpers import TinyNet, full_state, make_loader, snapshot, state_differences, trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from nan.test_detector import INJECT
from nan.test_repair import CULPRIT, _overflowing
from torch import nn
from torch.utils.data import DataLoader

from lightning_opkit import NaNDetector, NonFiniteError, PrecisionPolicy, replaying
from lightning_opkit.core.replay import (
    held_training,
    loss_of,
    preserved,
    quiet_logging,
    rng_state,
    run_step,
    set_rng_state,
    training_loss,
)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)
        self.acc = torchmetrics.MeanMetric()
        self.seen_replaying = []

    def forward(self, x):
        self.seen_replaying.append(replaying())
        out = self.drop(self.bn(self.lin(x)))
        self.acc.update(out.detach().mean())
        return out


def test_run_step_returns_loss_and_gradients_and_leaves_no_trace():
    torch.manual_seed(0)
    net = _Net()
    twin = copy.deepcopy(net)
    x = torch.randn(8, 4)
    grad_before = torch.full_like(net.lin.weight, 7.0)
    net.lin.weight.grad = grad_before.clone()
    buffers = [b.clone() for b in net.buffers()]
    rng = torch.get_rng_state()
    loss, grads = run_step(net, lambda: net(x).square().mean())
    # the same step trained plainly, from the same RNG state, on a copy: the same loss and gradients
    torch.set_rng_state(rng)
    expected = twin(x).square().mean()
    expected.backward()
    assert torch.equal(loss, expected.detach())
    assert not loss.requires_grad
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, twin.parameters(), strict=True))
    assert torch.equal(net.lin.weight.grad, grad_before)  # .grad untouched
    assert all(torch.equal(a, b) for a, b in zip(net.buffers(), buffers, strict=True))  # BatchNorm stats back
    assert net.acc.update_count == 0  # the metric's update undone
    assert twin.acc.update_count == 1
    assert net.seen_replaying == [True]
    assert not replaying()


def test_the_same_rng_state_replays_the_same_dropout_mask():
    torch.manual_seed(1)
    net = _Net()
    x = torch.randn(8, 4)
    state = rng_state()
    first, _ = run_step(net, lambda: net(x).sum(), backward=False)
    set_rng_state(state)
    second, _ = run_step(net, lambda: net(x).sum(), backward=False)
    assert torch.equal(first, second)


def test_preserved_hands_out_a_reset_between_two_runs():
    bn = nn.BatchNorm1d(2)
    with preserved(bn) as reset:
        bn(torch.randn(4, 2))
        assert bn.running_mean.abs().sum() > 0
        reset()
        assert bn.running_mean.tolist() == [0.0, 0.0]
        bn(torch.randn(4, 2))
    assert bn.running_mean.tolist() == [0.0, 0.0]


def test_quiet_logging_silences_log_and_log_dict_and_puts_them_back():
    calls = []

    class Module(nn.Module):
        def log(self, *args, **kwargs):
            calls.append(("log", args))

        def log_dict(self, *args, **kwargs):
            calls.append(("log_dict", args))

    module = Module()
    with quiet_logging(module):
        module.log("a", 1)
        module.log_dict({"b": 2})
    assert calls == []
    module.log("a", 1)
    assert calls == [("log", ("a", 1))]
    assert "log" not in vars(module)


def test_loss_of_reads_a_tensor_a_dict_and_an_output_object():
    t = torch.tensor(2.0)

    class Out:
        loss = t

    assert loss_of(t) is t
    assert loss_of({"loss": t}) is t
    assert loss_of(Out()) is t
    assert loss_of({"logits": t}) is None
    assert loss_of(None) is None


# NaNDetector under manual optimization (``automatic_optimization = False``): the user's step trains by itself.
#
# The replays run the user's ``training_step`` again with its ``manual_backward``, optimizer steps, ``zero_grad`` and
# LR scheduler steps held (``core/replay.py``), so a replay neither trains nor advances ``global_step``; the skip
# leaves the user's ``opt.step()`` out as it leaves Lightning's out under automatic optimization.
#


class BatchStates(pl.Callback):
    """The full state before and after each training batch, keyed ``("before" | "after", batch_idx)``."""

    def __init__(self):
        self.states = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.states[("before", batch_idx)] = full_state(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.states[("after", batch_idx)] = full_state(trainer, pl_module)


class ManualTinyNet(TinyNet):
    """TinyNet trained by its own ``training_step``: zero_grad, manual_backward, step, and the LR scheduler."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.trained_batches = 0  # training_step calls that trained (not a replay)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.global_step in self.loss_steps:
            loss = loss * torch.log(torch.zeros((), device=loss.device))
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        if self.use_scheduler:
            self.lr_schedulers().step()
        if not replaying():
            self.trained_batches += 1
        self.log("train_loss", loss)
        return loss


def _adam_steps(trainer) -> int:
    """How many updates Adam took (its per-parameter step count; a left-out step takes none)."""
    return int(next(iter(trainer.optimizers[0].state.values()))["step"])


@pytest.mark.parametrize("where", list(INJECT))
def test_raise_names_module_phase_and_step_and_replays_do_not_step(tmp_path, where):
    kwargs, phase, module, parameter = INJECT[where]
    model = ManualTinyNet(optimizer="adam", **kwargs)
    before = snapshot(model)
    detector = NaNDetector(action="raise")
    run = trainer(tmp_path, [detector], max_steps=5)
    with pytest.raises(NonFiniteError, match="global step 2") as info:
        run.fit(model, make_loader())
    report = info.value.report
    assert (report["step"], report["phase"], report["module"], report["parameter"]) == (2, phase, module, parameter)
    assert report["cause"] == "data_or_model"  # reproduced in fp32 too: not transient, as a replay that trains was
    assert detector.events == [report]  # one fault, one report
    # the replays (localization, two cause replays) neither counted a step nor updated: steps 0 and 1 only
    assert run.global_step == 2
    assert _adam_steps(run) == 2
    assert snapshot(model) == before


@pytest.mark.parametrize("where", list(INJECT))
def test_skip_leaves_the_users_step_out_with_nothing_changed(tmp_path, where):
    kwargs = INJECT[where][0]
    model = ManualTinyNet(optimizer="adam", scheduler=True, **kwargs)
    probe = BatchStates()
    states = probe.states
    detector = NaNDetector(action="skip")
    run = trainer(tmp_path, [detector, probe], max_steps=5)
    run.fit(model, make_loader())
    # weights, Adam's state and the per-step LR schedule exactly as before the bad batch
    assert state_differences(states[("before", 2)], states[("after", 2)]) == []
    assert state_differences(states[("before", 1)], states[("after", 1)]) != []  # a good batch does train
    assert [(e["step"], e["module"], e["action"]) for e in detector.events] == [(2, INJECT[where][2], "skip")]
    assert detector.skipped_steps == 1
    # Lightning counts the user's opt.step() calls, the left-out one too: 5 steps, 4 updates, 5 batches trained
    assert (run.global_step, _adam_steps(run), model.trained_batches) == (5, 4, 5)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_equals_a_run_that_never_saw_the_batch(tmp_path):
    batches = list(make_loader())
    torch.manual_seed(0)
    faulty = ManualTinyNet(forward_steps=(2,), optimizer="adam")
    trainer(tmp_path / "a", [NaNDetector(action="skip")], max_steps=5).fit(faulty, DataLoader(batches, batch_size=None))
    torch.manual_seed(0)
    reference = ManualTinyNet(optimizer="adam")
    trainer(tmp_path / "b", [], max_steps=4).fit(reference, DataLoader(batches[:2] + batches[3:5], batch_size=None))
    for (name, a), b in zip(faulty.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name


def test_every_optimizer_step_of_a_skipped_batch_is_left_out(tmp_path):
    class TwoOptimizers(ManualTinyNet):
        def training_step(self, batch, batch_idx):
            body, head = self.optimizers()
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            body.zero_grad()
            head.zero_grad()
            self.manual_backward(loss)
            body.step()
            head.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.body.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1)

    model = TwoOptimizers(forward_steps=(2,))  # global step 2 is batch 1: two steps a batch
    probe = BatchStates()
    states = probe.states
    detector = NaNDetector(action="skip")
    trainer(tmp_path, [detector, probe], max_steps=8).fit(model, make_loader())
    assert state_differences(states[("before", 1)], states[("after", 1)]) == []
    assert [(e["step"], e["module"]) for e in detector.events] == [(2, "body.1")]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_fp16_overflow_is_named_pinned_and_training_goes_on(tmp_path):
    class ManualGPT2(type(_overflowing())):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = self(batch)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return loss

    torch.manual_seed(0)
    model = _overflowing()
    model.__class__ = ManualGPT2
    model.automatic_optimization = False
    before = snapshot(model)
    detector = NaNDetector(action="skip")
    losses = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    scaler = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    run = trainer(tmp_path, [detector, Losses()], max_steps=6, plugins=[scaler])
    run.fit(model, model.loader(n=48))
    assert [(e["step"], e["module"], e["phase"], e["cause"]) for e in detector.events] == [
        (0, CULPRIT, "forward", "precision")]
    assert detector.events[0]["repair"] == f"{CULPRIT} -> fp32"
    assert not math.isfinite(losses[0])
    assert len(losses) == 6
    assert all(math.isfinite(x) for x in losses[1:]), losses
    assert snapshot(model) == before


def test_training_loss_holds_every_step_a_manual_training_step_takes(tmp_path):
    model = ManualTinyNet(optimizer="adam", scheduler=True)
    run = trainer(tmp_path, [], max_steps=2)
    run.fit(model, make_loader())
    before = full_state(run, model)
    step = vars(run.optimizers[0]).get("step")  # torch's LR scheduler wraps it already
    batch = next(iter(make_loader()))
    loss = training_loss(model, batch, 0)
    x, y = batch
    assert torch.equal(loss.detach(), F.cross_entropy(model(x), y).detach())
    assert state_differences(before, full_state(run, model)) == []
    assert run.global_step == 2
    assert "manual_backward" not in vars(model)
    assert vars(run.optimizers[0]).get("step") is step
    with held_training(model) as losses:
        model.manual_backward(loss)
        run.optimizers[0].step()
    assert losses == [loss]
    assert state_differences(before, full_state(run, model)) == []


def test_precision_policy_measures_a_manually_optimized_model(tmp_path):
    model = ManualTinyNet(optimizer="adam")
    policy = PrecisionPolicy(rules="auto", census_every_n_steps=0)
    run = trainer(tmp_path, [policy], max_steps=3)
    run.fit(model, make_loader())
    assert policy.measurements is not None  # measured, on runs that trained nothing
    assert (run.global_step, _adam_steps(run), model.trained_batches) == (3, 3, 3)
