"""NaNDetector(decide="device"): a bad step's update left out on the device by a fused optimizer, read a step late."""

import lightning.pytorch as pl
import pytest
import torch
from helpers import StepProbe, TinyNet, full_state, make_loader, read_events, snapshot, state_differences, trainer
from zoo import CASES, build

from lightning_opkit import NaNDetector, NonFiniteError, TorchCompile
from lightning_opkit.core.patch import Patches
from lightning_opkit.nan.actions import StepSkipper
from lightning_opkit.nan.device import DeviceDecision

FAULTS = {"forward": 1, "backward": 2, "param": 3, "loss": 4}
LR_ONLY = {"state.optim[0].param_groups[0].lr", "state.lr[0]"}


class ReportsSeen(pl.Callback):
    """How many reports the detector had at the end of each step: when a fault became known on the host."""

    def __init__(self, detector):
        self.detector = detector
        self.seen: dict[int, int] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen[trainer.global_step - 1] = len(self.detector.reports)


def _run(tmp_path, decide, **model_kwargs):
    torch.manual_seed(0)
    model = TinyNet(optimizer="fused_adamw", **model_kwargs)
    detector = NaNDetector(action="skip", decide=decide)
    seen = ReportsSeen(detector)
    trainer(tmp_path, [detector, seen], max_steps=6).fit(model, make_loader())
    return model, detector, seen.seen


@pytest.mark.parametrize("where", ["forward_steps", "backward_steps", "loss_steps", "param_grad_steps"])
def test_the_device_decision_trains_exactly_as_the_host_skip_and_reports_a_step_late(tmp_path, where):
    host_model, host, host_seen = _run(tmp_path / "host", "host", **{where: (2,)})
    device_model, device, device_seen = _run(tmp_path / "device", "device", **{where: (2,)})
    for (name, a), b in zip(host_model.named_parameters(), device_model.parameters()):
        assert torch.equal(a, b), name  # the left-out update: bit for bit what the host's skip leaves
    fields = ("step", "phase", "module", "parameter", "nan", "inf")
    assert [[e[k] for k in fields] for e in device.events] == [[e[k] for k in fields] for e in host.events]
    assert [e["step"] for e in device.events] == [2]
    assert device.skipped_steps == host.skipped_steps == 1
    assert host_seen[2] == 1
    assert (device_seen[2], device_seen[3]) == (0, 1)  # read at the next step, not between backward and step


@pytest.mark.parametrize("name", list(CASES))
def test_zoo_faults_are_named_and_their_updates_left_out_on_the_device(tmp_path, name):
    model = build(name, faults=FAULTS, fused=True)
    before = snapshot(model)
    detector = NaNDetector(action="skip", decide="device")
    probe = StepProbe(steps=FAULTS.values())
    trainer(tmp_path, [detector, probe], max_steps=6, max_epochs=-1).fit(model, model.loader())
    events = {e["step"]: e for e in detector.events}
    assert sorted(events) == sorted(FAULTS.values()), detector.events
    assert (events[1]["phase"], events[1]["module"]) == ("forward", "model." + model.case.deep)
    assert events[3]["parameter"] == "model." + model.case.param
    assert (events[4]["phase"], events[4]["module"]) == ("loss", "")
    for step in FAULTS.values():
        # weights, optimizer state (its step count too) and BatchNorm statistics bit-identical; the per-step LR
        # schedule advanced: the host did not know in time
        differences = set(state_differences(probe.before[step], probe.after[step]))
        assert differences == LR_ONLY, (step, differences)
    assert snapshot(model) == before
    assert not hasattr(model.optimizers().optimizer, "found_inf")


def test_raise_comes_a_step_late_with_the_model_as_before_the_bad_batch(tmp_path):
    model = build("bn_cnn", faults={"forward": 2}, fused=True)
    before = snapshot(model)
    probe = StepProbe(steps=[2])
    trainer_ = trainer(tmp_path, [NaNDetector(action="raise", decide="device"), probe], max_steps=6, max_epochs=-1)
    with pytest.raises(NonFiniteError, match="global step 2") as info:
        trainer_.fit(model, model.loader())
    assert (info.value.report["phase"], info.value.report["module"]) == ("forward", "model." + model.case.deep)
    # step 3 ran forward and backward, but neither its update nor its BatchNorm statistics were kept
    assert trainer_.global_step == 3
    differences = set(state_differences(probe.before[2], full_state(trainer_, model)))
    assert differences == LR_ONLY, differences
    assert snapshot(model) == before  # no hook, patch or mode left by the exception
    assert not hasattr(trainer_.optimizers[0], "found_inf")


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_regions_decide_on_the_device_alike(tmp_path, backend):
    model = build("hf_gpt2", faults=FAULTS, fused=True)
    before = snapshot(model)
    detector = NaNDetector(action="skip", decide="device")
    compiler = TorchCompile(modules=["model." + model.case.blocks], backend=backend)
    probe = StepProbe(steps=FAULTS.values())
    trainer(tmp_path, [detector, compiler, probe], max_steps=6, max_epochs=-1).fit(model, model.loader())
    assert compiler.compiled
    events = {e["step"]: e for e in detector.events}
    assert sorted(events) == sorted(FAULTS.values()), detector.events
    assert (events[1]["phase"], events[1]["module"]) == ("forward", "model." + model.case.deep)
    assert (events[4]["phase"], events[4]["module"]) == ("loss", "")
    for step in FAULTS.values():
        assert set(state_differences(probe.before[step], probe.after[step])) == LR_ONLY, step
    assert snapshot(model) == before


def test_stop_leaves_the_next_step_out_too_and_ends_on_the_weights_before_the_bad_batch(tmp_path):
    model = build("bn_cnn", faults={"backward": 2}, fused=True)
    probe = StepProbe(steps=[2])
    trainer_ = trainer(tmp_path, [NaNDetector(action="stop", decide="device"), probe], max_steps=8, max_epochs=-1)
    trainer_.fit(model, model.loader())
    assert trainer_.global_step == 4  # step 3 ran forward and backward, then was left out; the run stopped
    differences = set(state_differences(probe.before[2], full_state(trainer_, model)))
    assert differences == LR_ONLY, differences


def test_a_fault_at_the_last_step_is_read_at_the_epoch_end(tmp_path):
    torch.manual_seed(0)
    detector = NaNDetector(action="warn", decide="device")
    with pytest.warns(UserWarning, match="skipped on the device"):
        trainer(tmp_path, [detector], max_steps=4).fit(TinyNet(optimizer="fused_adamw", forward_steps=(3,)),
                                                       make_loader())
    assert [(e["step"], e["module"]) for e in detector.events] == [(3, "body.1")]
    assert detector.summary_lines()[0].startswith("NaN/Inf: 1 event(s), 1 skipped step(s) (action='warn', decided on"
                                                  " the device: read a step late); first at step 3")
    scalars, _ = read_events(str(tmp_path))
    assert scalars["opkit/nan/skipped_steps"][-1][1] == 1.0


def test_every_n_steps_reads_at_the_next_step_even_unchecked(tmp_path):
    torch.manual_seed(0)
    detector = NaNDetector(action="skip", decide="device", every_n_steps=2)
    seen = ReportsSeen(detector)
    trainer(tmp_path, [detector, seen], max_steps=6).fit(TinyNet(optimizer="fused_adamw", forward_steps=(2,)),
                                                         make_loader())
    assert [e["step"] for e in detector.events] == [2]
    assert (seen.seen[2], seen.seen[3]) == (0, 1)


def test_a_checkpoint_between_the_bad_step_and_the_next_carries_its_fault(tmp_path):
    torch.manual_seed(0)
    every = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1, save_top_k=-1)
    detector = NaNDetector(action="skip", decide="device")
    trainer(tmp_path, [detector, every], max_steps=5, enable_checkpointing=True).fit(
        TinyNet(optimizer="fused_adamw", forward_steps=(2,)), make_loader())
    # saved at the end of step 2, before step 3 read the flags: the fault is in it, read by the checkpoint
    saved = torch.load(str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt"), weights_only=False)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("NaNDetector")]
    assert [(e["step"], e["module"]) for e in state["events"]] == [(2, "body.1")]
    assert state["skipped_steps"] == 1
    assert [e["step"] for e in detector.events] == [2]  # once, not again at step 3


class Manual(TinyNet):
    def __init__(self):
        super().__init__(optimizer="fused_adamw")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()


def test_device_decision_needs_a_fused_optimizer_and_no_grad_scaler(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    with pytest.raises(ValueError, match=r"SGD here is not fused.*fused=True"):
        trainer(tmp_path, [NaNDetector(decide="device")], max_steps=2).fit(TinyNet(), make_loader())
    with pytest.raises(ValueError, match="GradScaler"):
        trainer(tmp_path, [NaNDetector(decide="device")], max_steps=2,
                plugins=[MixedPrecision("16-mixed", "cpu")]).fit(TinyNet(optimizer="fused_adamw"), make_loader())
    with pytest.raises(ValueError, match="automatic optimization"):
        trainer(tmp_path, [NaNDetector(decide="device")], max_steps=2).fit(Manual(), make_loader())


@pytest.mark.parametrize("kwargs, match", [
    (dict(decide="gpu"), r"`decide` to be one of \['host', 'device'\], but got 'gpu'"),
    (dict(decide="device", spike_zscore=6.0), "spike_zscore=6.0 needs decide='host'"),
])
def test_bad_decide_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NaNDetector(**kwargs)


def test_decide_from_the_cli():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--callbacks", type=list[pl.Callback])
    cfg = parser.parse_args(["--callbacks+=lightning_opkit.NaNDetector", "--callbacks.decide=device",
                             "--callbacks.action=skip"])
    (detector,) = parser.instantiate_classes(cfg).callbacks
    assert (type(detector), detector.decide, detector.action) == (NaNDetector, "device", "skip")
    with pytest.raises(Exception, match="decide"):
        parser.parse_args(["--callbacks+=lightning_opkit.NaNDetector", "--callbacks.decide=gpu"])


@pytest.mark.parametrize("decide", ["host", "device"])
def test_a_skip_counts_as_a_step_so_max_steps_10_with_one_skip_makes_9_updates(tmp_path, decide):
    # Lightning's global_step counts optimizer-step calls, the left-out one included (the NaNDetector page says so)
    model = TinyNet(optimizer="fused_adamw", forward_steps=(3,))
    detector = NaNDetector(action="skip", decide=decide)
    run = trainer(tmp_path, [detector], max_steps=10, max_epochs=-1)
    run.fit(model, make_loader())
    assert run.global_step == 10
    assert detector.skipped_steps == 1
    updates = {int(state["step"]) for state in run.optimizers[0].state.values()}
    assert updates == {9}


def test_leave_hands_the_flag_to_found_inf_and_the_buffers_and_copies_it_for_the_next_step():
    buffer = torch.zeros(2)
    skipper = StepSkipper(Patches())
    skipper.watch_buffers([buffer])
    skipper.begin_batch(checking=True, save_buffers=True)
    buffer.fill_(5.0)  # what the bad step's forward wrote
    decision = DeviceDecision()
    found = torch.tensor([0.3, float("inf"), 0.0])  # flags(): the loss, a non-finite gradient norm, no dead flag
    decision.leave(found, skipper, pending=[], step=4, epoch=1)
    assert float(skipper.found_inf) == 1.0  # the fused optimizer leaves its update out
    assert buffer.tolist() == [0.0, 0.0]  # put back on the device
    assert (decision.late.step, decision.late.epoch) == (4, 1)
    assert decision.late.found.read() == found.tolist()
