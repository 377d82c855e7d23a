"""The slow path's replays (nan/replays.py), driven directly from inside a real fit (no NaNDetector attached): a step
whose module goes non-finite is named at that module with its cause; a fault only in backward is no forward fault; a
step that was healthy is not reproduced; the model is as it was after each replay."""

import lightning.pytorch as pl
import torch
from helpers import make_loader, snapshot, trainer
from torch import nn

from lightning_opkit.core.replay import rng_state
from lightning_opkit.nan.replays import MicroBatch, Replays, ran_compiled


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


def test_without_a_compiling_callback_the_step_ran_eagerly(tmp_path):
    assert not ran_compiled(pl.Trainer(logger=False, enable_progress_bar=False, callbacks=[]))

