"""Repair on precision faults: a fp16 forward overflow's culprit is pinned to fp32, and training goes on.

The zoo's GPT-2 (eager attention) with its first block's query and key projections scaled up, as attention logits
grow at a high learning rate: in fp16 the logits overflow to inf and the softmax makes NaN; in fp32 they are large and
finite. The detector names the attention module, replays it in fp32 (finite: cause ``precision``), skips the step and
pins the module to fp32; every later step is finite. (PyTorch's fused attention accumulates in fp32 on a CPU and does
not overflow: the eager attention is where a fp16 model meets this.)
"""

import math

import lightning.pytorch as pl
import pytest
import torch
from helpers import TESTS, read_events, snapshot, trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from zoo import DIM, ZooModule

from lightning_opkit import NaNDetector, NonFiniteError, PrecisionPolicy
from lightning_opkit.nan.repair import Repairs

CULPRIT = "model.transformer.h.0.attn"


class _SGD(ZooModule):
    """The zoo module with plain SGD: AdamW's eps (1e-8) is 0 in fp16, so under 16-true it divides zero by zero."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)


def _overflowing(scale: float = 4000.0, sgd: bool = False):
    torch.manual_seed(0)
    model = (_SGD if sgd else ZooModule)("hf_gpt2")
    model.model.set_attn_implementation("eager")
    with torch.no_grad():  # Conv1D's weight is [in, 3 * out]: queries and keys first; logits grow as scale^2
        model.model.transformer.h[0].attn.c_attn.weight[:, : 2 * DIM].mul_(scale)
    return model


class Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append((trainer.global_step, float(outputs["loss"])))


def _precision(setup):
    """Trainer arguments and extra callbacks for a fp16 setup."""
    scaler = dict(plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))])
    if setup == "16-mixed":
        return scaler, []
    if setup == "policy-fp16":
        return scaler, [PrecisionPolicy(rules={"matmul": "fp16", "attention": "fp16"}, measure=False,
                                        census_every_n_steps=0)]
    return dict(precision="16-true"), []


@pytest.mark.parametrize("setup", ["16-mixed", "policy-fp16", "16-true"])
def test_a_fp16_forward_overflow_is_pinned_to_fp32_and_training_goes_on(tmp_path, setup):
    kwargs, extra = _precision(setup)
    model, detector, losses = _overflowing(sgd=setup == "16-true"), NaNDetector(action="skip"), Losses()
    before = snapshot(model)
    run = trainer(tmp_path, [*extra, detector, losses], max_steps=6, **kwargs)
    run.fit(model, model.loader(n=48))
    assert run.global_step == 6
    assert detector.skipped_steps == 1  # the step that overflowed, and only it
    event = detector.events[0]
    assert (event["step"], event["module"], event["phase"], event["cause"]) == (0, CULPRIT, "forward", "precision")
    assert event["repair"] == f"{CULPRIT} -> fp32"
    assert "runs in fp32 from the next step on" in event["advice"]
    assert len(detector.events) == 1
    # the first batch's loss overflowed; every one after the repair is finite
    assert not math.isfinite(losses.losses[0][1])
    assert len(losses.losses) == 6
    assert all(math.isfinite(loss) for _, loss in losses.losses[1:]), losses.losses
    scalars, texts = read_events(str(tmp_path))
    assert scalars["opkit/nan/repairs"][-1][1] == 1
    assert CULPRIT in texts["opkit/summary"][-1][1]
    assert "repaired" in texts["opkit/summary"][-1][1]
    assert snapshot(model) == before  # teardown undid the pin with every other hook


def test_repair_off_keeps_skipping_until_the_limit(tmp_path):
    kwargs, _ = _precision("16-mixed")
    model = _overflowing()
    detector = NaNDetector(action="skip", repair=False, max_consecutive_skips=3)
    with pytest.raises(NonFiniteError, match="skipped 3 steps in a row"):
        trainer(tmp_path, [detector], max_steps=6, **kwargs).fit(model, model.loader(n=48))
    assert all(e["repair"] is None for e in detector.events)
    assert "loss scaling cannot fix a forward overflow" in detector.events[0]["advice"]


def test_a_resumed_run_keeps_the_pin(tmp_path):
    kwargs, _ = _precision("16-mixed")
    model = _overflowing()
    first = NaNDetector(action="skip")
    run = trainer(tmp_path / "a", [first], max_steps=3, **kwargs)
    run.fit(model, model.loader(n=48))
    run.save_checkpoint(tmp_path / "repaired.ckpt")
    assert first.state_dict()["repairs"] == {CULPRIT: "fp32"}
    again, losses = NaNDetector(action="skip"), Losses()
    resumed = _overflowing()  # the same overflowing weights: unpinned, its first step would overflow again
    trainer(tmp_path / "b", [again, losses], max_steps=6, max_epochs=3, **kwargs).fit(
        resumed, resumed.loader(n=48), ckpt_path=str(tmp_path / "repaired.ckpt"))
    assert again.skipped_steps == first.skipped_steps == 1  # no new skip: pinned from the resumed run's first step
    assert all(math.isfinite(loss) for _, loss in losses.losses)
    assert len(losses.losses) == 3


def test_under_ddp_both_ranks_pin_the_same_module(tmp_path):
    import os

    from test_ddp import run_two_ranks

    r0, r1 = run_two_ranks(os.path.join(TESTS, "ddp_repair_script.py"), tmp_path, "-")
    assert r0["events"] == r1["events"] == [[0, CULPRIT, "precision", f"{CULPRIT} -> fp32"]]
    assert r0["repairs"] == r1["repairs"] == {CULPRIT: "fp32"}
    assert r0["finite_after"] == r1["finite_after"] == [True] * 4
    assert r0["weights"] == r1["weights"]  # still in lockstep


class _Amplify(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e6  # whatever the loss scale, this gradient overflows fp16 until the scale is tiny


class Amplify(torch.nn.Module):
    def forward(self, x):
        return _Amplify.apply(x)


def test_a_grad_scaler_collapse_is_reported_once_with_its_module(tmp_path):
    from helpers import TinyNet, make_loader

    kwargs, _ = _precision("16-mixed")
    model = TinyNet()
    model.body[3] = Amplify()  # after the ReLU, in the fp16 activations autocast makes
    detector = NaNDetector(action="warn", repair=False)
    with pytest.warns(UserWarning, match="scale fell from 65536 to 64 over 11 steps it skipped in a row"):
        trainer(tmp_path, [detector], max_steps=14, **kwargs).fit(model, make_loader(n=128))
    assert len(detector.events) == 1  # once, not at every skipped step
    event = detector.events[0]
    assert (event["step"], event["phase"], event["module"]) == (10, "backward", "body.3")
    assert event["cause"] == "precision"
    assert "loss scaling cannot fix" in event["advice"]
    assert "PrecisionPolicy(overrides={'body.3': 'fp32'})" in event["advice"]
    assert detector.skipped_steps == 0  # the scaler skipped them, not the detector


def test_repairs_without_a_policy_run_a_weightless_module_of_a_16_bit_model_in_fp32_handing_on_16_bits():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)).half()
    x = torch.ones(2, 4, dtype=torch.half)
    seen = []
    model[1].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    repairs = Repairs()
    assert repairs.pin(model, "1", pinner=None) == "1 -> fp32"
    assert model(x).dtype == torch.half  # handed on in the next module's dtype
    assert seen[-1] == torch.float32  # its own output in fp32
    repairs.release()
    model(x)
    assert seen[-1] == torch.half
    assert repairs.pinned == {"1": "fp32"}  # kept for the state: applied again on the next fit
    repairs.apply_all(model, pinner=None)
    model(x)
    assert seen[-1] == torch.float32
    repairs.release()
