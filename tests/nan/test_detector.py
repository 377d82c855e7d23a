import json
import os
import subprocess
import sys
import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import ROOT, TESTS, TinyNet, make_loader, read_events, snapshot, trainer

from lightning_opkit import NonFiniteError
from lightning_opkit.nan.detector import NaNDetector

INJECT = {
    "forward": (dict(forward_steps=(2,)), "forward", "body.1", None),
    "backward": (dict(backward_steps=(2,)), "backward", "body.3", None),
    "param_grad": (dict(param_grad_steps=(2,)), "backward", "head", "head.bias"),
    "loss": (dict(loss_steps=(2,)), "loss", "", None),
}


@pytest.mark.parametrize("where", list(INJECT))
def test_raise_names_module_phase_and_step(tmp_path, where):
    kwargs, phase, module, parameter = INJECT[where]
    model = TinyNet(**kwargs)
    before = snapshot(model)
    detector = NaNDetector(action="raise")
    with pytest.raises(NonFiniteError, match="global step 2") as info:
        trainer(tmp_path, [detector], max_steps=5).fit(model, make_loader())
    report = info.value.report
    assert (report["step"], report["phase"], report["module"], report["parameter"]) == (2, phase, module, parameter)
    assert report["nan"] + report["inf"] > 0
    assert detector.events == [report]
    assert snapshot(model) == before  # cleaned up on the exception path
    _, texts = read_events(str(tmp_path))
    assert "opkit/nan/report" in texts
    assert module in texts["opkit/nan/report"][0][1]


def test_forward_report_has_module_type_dtype_and_input_range(tmp_path):
    detector = NaNDetector()
    with pytest.raises(NonFiniteError) as info:
        trainer(tmp_path, [detector], max_steps=4).fit(TinyNet(forward_steps=(1,)), make_loader())
    r = info.value.report
    assert (r["module_type"], r["dtype"], r["nan"], r["inf"]) == ("Poison", "float32", 1, 0)
    assert r["input_min"] < 0 < r["input_max"]
    assert r["input_absmax"] == max(-r["input_min"], r["input_max"])
    text = str(info.value)
    assert "'body.1' (Poison" in text
    assert "forward" in text


def test_inf_in_forward_is_counted_as_inf(tmp_path):
    model = TinyNet(forward_steps=(1,))
    model.body[1].value = float("inf")
    with pytest.raises(NonFiniteError) as info:
        trainer(tmp_path, [NaNDetector()], max_steps=3).fit(model, make_loader())
    assert (info.value.report["module"], info.value.report["inf"]) == ("body.1", 1)


@pytest.mark.parametrize("where", ["forward", "backward", "param_grad"])
def test_skip_leaves_weights_and_optimizer_state_bit_identical(tmp_path, where):
    kwargs = INJECT[where][0]
    model = TinyNet(optimizer="adam", **kwargs)
    seen = {}

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2:
                seen["weights"] = {k: v.clone() for k, v in pl_module.state_dict().items()}
                opt = trainer.optimizers[0]
                seen["opt"] = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if "after" not in seen and "weights" in seen:
                seen["after"] = {k: v.clone() for k, v in pl_module.state_dict().items()}
                opt = trainer.optimizers[0]
                seen["opt_after"] = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
                seen["step_after"] = trainer.global_step

    detector = NaNDetector(action="skip")
    trainer(tmp_path, [detector, Spy()], max_steps=5).fit(model, make_loader())
    assert seen["step_after"] == 3  # the skipped step still counts as a step
    for key, value in seen["weights"].items():
        assert torch.equal(value, seen["after"][key]), key
    assert seen["opt"].keys() == seen["opt_after"].keys()
    for pid, state in seen["opt"].items():
        for k, v in state.items():
            assert torch.equal(v, seen["opt_after"][pid][k])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert detector.skipped_steps == 1
    assert len(detector.events) == 1
    assert detector.events[0]["step"] == 2
    scalars, _ = read_events(str(tmp_path))
    assert scalars["opkit/nan/events"] == [(2, 1.0), (5, 1.0)]  # at the event, then at the epoch's end
    assert scalars["opkit/nan/skipped_steps"] == [(2, 1.0), (5, 1.0)]


def test_skip_does_not_step_the_lr_scheduler(tmp_path):
    model = TinyNet(forward_steps=(1, 2), scheduler=True)
    lrs = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer(tmp_path, [NaNDetector(action="skip"), Spy()], max_steps=5).fit(model, make_loader())
    # StepLR halves per step; the two skipped steps (1 and 2) do not halve it.
    assert lrs == pytest.approx([0.05, 0.05, 0.05, 0.025, 0.0125])
    assert "lr_scheduler_step" not in vars(model)


def test_skip_raises_after_max_consecutive_skips(tmp_path):
    detector = NaNDetector(action="skip", max_consecutive_skips=2)
    with pytest.raises(NonFiniteError, match="skipped 2 steps in a row"):
        trainer(tmp_path, [detector], max_steps=8).fit(TinyNet(forward_steps=(1, 2, 3, 4)), make_loader())
    assert [e["step"] for e in detector.events] == [1, 2, 3]


def test_what_is_done_about_a_fault_is_held_once_and_a_change_after_construction_takes_effect(tmp_path):
    detector = NaNDetector(action="raise", max_consecutive_skips=1)
    detector.action, detector.max_consecutive_skips = "skip", 3  # as a script may set them before fit
    trainer(tmp_path, [detector], max_steps=6).fit(TinyNet(forward_steps=(1, 2)), make_loader())
    assert detector.skipped_steps == 2  # skipped, not raised at step 1, and two in a row allowed
    assert [e["action"] for e in detector.events] == ["skip", "skip"]
    assert detector.state_key == NaNDetector(action="skip").state_key


def test_warn_skips_and_warns(tmp_path):
    model = TinyNet(backward_steps=(1,))
    detector = NaNDetector(action="warn")
    with pytest.warns(UserWarning, match="body.3"):
        trainer(tmp_path, [detector], max_steps=4).fit(model, make_loader())
    assert detector.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_stop_ends_training_after_logging(tmp_path):
    detector = NaNDetector(action="stop")
    t = trainer(tmp_path, [detector], max_steps=6)
    model = TinyNet(loss_steps=(2,))
    t.fit(model, make_loader())
    assert t.global_step == 3
    assert t.should_stop
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert read_events(str(tmp_path))[0]["opkit/nan/events"] == [(2, 1.0), (3, 1.0)]


def test_every_n_steps_checks_only_those_steps(tmp_path):
    detector = NaNDetector(action="skip", every_n_steps=2)
    # Steps 2 and 3 are poisoned; only step 2 is checked (step 3's NaN reaches the weights unseen).
    model = TinyNet(forward_steps=(2, 3))
    trainer(tmp_path, [detector], max_steps=4).fit(model, make_loader())
    assert [e["step"] for e in detector.events] == [2]
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_gradient_accumulation_localizes_the_bad_micro_batch(tmp_path):
    # With 2 micro-batches per step, step 1 is batches 2 and 3; only that step's check sees the NaN.
    model = TinyNet(forward_steps=(1,))
    detector = NaNDetector(action="skip")
    trainer(tmp_path, [detector], max_steps=3, accumulate_grad_batches=2).fit(model, make_loader())
    assert [(e["step"], e["module"], e["batch_idx"]) for e in detector.events] == [(1, "body.1", 2)]


def test_modules_globs_restrict_localization(tmp_path):
    detector = NaNDetector(modules=["head"])  # the culprit body.1 is not watched: its NaN shows in the loss
    with pytest.raises(NonFiniteError) as info:
        trainer(tmp_path, [detector], max_steps=4).fit(TinyNet(forward_steps=(1,)), make_loader())
    assert info.value.report["phase"] == "loss"


def test_modules_glob_matching_nothing_fails_at_setup_with_names(tmp_path):
    with pytest.raises(ValueError, match=r"'hed'.*'head'"):
        trainer(tmp_path, [NaNDetector(modules=["hed"])], max_steps=1).fit(TinyNet(), make_loader())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(action="ignore"), r"`action`.*\['raise', 'skip', 'warn', 'stop'\].*'ignore'"),
        (dict(every_n_steps=-1), "`every_n_steps`.*-1"),  # 0 is off
        (dict(max_consecutive_skips=0), "`max_consecutive_skips`"),
        (dict(check_forward=False, check_backward=False, check_loss=False), "At least one"),
        (dict(modules="head"), "`modules`"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NaNDetector(**kwargs)


def test_bf16_mixed(tmp_path):
    with pytest.raises(NonFiniteError) as info:
        trainer(tmp_path, [NaNDetector()], max_steps=4, precision="bf16-mixed").fit(
            TinyNet(forward_steps=(1,)), make_loader())
    assert info.value.report["module"] == "body.1"
    assert info.value.report["dtype"] == "bfloat16"


def test_state_survives_checkpoint_resume(tmp_path):
    detector = NaNDetector(action="skip")
    t = trainer(tmp_path, [detector], max_epochs=1)
    t.fit(TinyNet(forward_steps=(1,)), make_loader(n=32))
    ckpt = os.path.join(tmp_path, "resume.ckpt")
    t.save_checkpoint(ckpt)
    resumed = NaNDetector(action="skip")
    trainer(tmp_path, [resumed], max_epochs=2).fit(TinyNet(forward_steps=(4,)), make_loader(n=32), ckpt_path=ckpt)
    assert (resumed.skipped_steps, [e["step"] for e in resumed.events]) == (2, [1, 4])


def test_clean_run_logs_zero_counters_and_leaves_no_hooks(tmp_path):
    model = TinyNet()
    counts = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            counts.append(sum(len(m._forward_hooks) + len(m._backward_hooks) for m in pl_module.modules()))

    trainer(tmp_path, [NaNDetector(), Spy()], max_steps=3).fit(model, make_loader())
    assert counts == [0, 0, 0]
    scalars, texts = read_events(str(tmp_path))
    assert scalars["opkit/nan/events"] == [(3, 0.0)]
    assert "opkit/nan/report" not in texts


DDP_SCRIPT = os.path.join(TESTS, "ddp_nan_script.py")


@pytest.mark.parametrize("action, decide", [("raise", "host"), ("skip", "host"), ("raise", "device"),
                                                ("skip", "device")])
def test_ddp_two_ranks_agree(tmp_path, action, decide):
    out = tmp_path / "out"
    out.mkdir()
    for attempt in (1, 2):  # a native abort at interpreter exit (once in ~4 runs of a CUDA wheel): run it again
        proc = subprocess.run([sys.executable, DDP_SCRIPT, str(out), action, decide], capture_output=True, text=True,
                              timeout=240, cwd=ROOT)
        if proc.returncode >= 0 or attempt == 2:
            break
        warnings.warn(f"ddp_nan_script.py: killed by signal {-proc.returncode}; running it again", stacklevel=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        # Only rank 1 saw the NaN; both ranks took the same action at the same step and name the same module.
        assert r["events"] == [[3, "forward", "body.1", 1]], r
        assert r["outcome"] == ("raised" if action == "raise" else "finished")
    if action == "skip":
        assert results[0]["weights"] == results[1]["weights"]
        assert results[0]["global_step"] == results[1]["global_step"] == 6


def test_under_a_grad_scaler_gradient_overflow_is_left_to_the_scaler(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    lrs = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    detector = NaNDetector(action="raise")
    model = TinyNet(param_grad_steps=(2,), scheduler=True)
    trainer(tmp_path, [detector, Spy()], max_steps=4, plugins=[MixedPrecision("16-mixed", "cpu")]).fit(
        model, make_loader())
    # the scaler skipped step 2 (no raise, no event) and so did the per-step schedule
    assert detector.events == []
    assert lrs == pytest.approx([0.05, 0.025, 0.025, 0.0125])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(NonFiniteError, match="loss"):
        trainer(tmp_path, [NaNDetector()], max_steps=4, plugins=[MixedPrecision("16-mixed", "cpu")]).fit(
            TinyNet(loss_steps=(2,)), make_loader())


def test_replay_leaves_torchmetrics_and_logged_values_as_they_were(tmp_path):
    from torchmetrics import MeanMetric

    class Metered(TinyNet):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.seen = MeanMetric()

        def training_step(self, batch, batch_idx):
            self.seen.update(batch[0].abs().mean())
            return super().training_step(batch, batch_idx)

    model = Metered(forward_steps=(2,))
    detector = NaNDetector(action="skip")
    trainer(tmp_path, [detector], max_steps=4).fit(model, make_loader())
    assert [e["step"] for e in detector.events] == [2]  # step 2 was replayed
    assert model.seen._update_count == 4  # one update per real step, none from the replay
    expected = torch.stack([b[0].abs().mean() for b, _ in zip(make_loader(), range(4))]).mean()
    assert torch.allclose(model.seen.compute(), expected)


class InplaceNet(TinyNet):
    """ReLU(inplace=True) on a Linear's output: full backward hooks on the Linear cannot be used in the replay."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.body[2] = torch.nn.ReLU(inplace=True)


@pytest.mark.parametrize("where", ["forward", "param_grad"])
def test_replay_copes_with_inplace_modules(tmp_path, where):
    kwargs, phase, module, parameter = INJECT[where]
    # Poison sits between Linear and ReLU; move the in-place ReLU right after the Linear
    model = InplaceNet(**kwargs)
    model.body = torch.nn.Sequential(model.body[0], torch.nn.ReLU(inplace=True), model.body[1], model.body[3])
    with pytest.raises(NonFiniteError) as info:
        trainer(tmp_path, [NaNDetector()], max_steps=4).fit(model, make_loader())
    report = info.value.report
    expected_module = "body.2" if where == "forward" else module
    assert (report["phase"], report["module"], report["parameter"]) == (phase, expected_module, parameter)


class LossReadsSomeRows(TinyNet):
    """TinyNet whose loss skips the batch's first row: a NaN there reaches the gradients but not the loss."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x)[1:], y[1:])


def test_under_a_grad_scaler_a_forward_nan_the_loss_never_reads_is_a_fault_not_an_overflow(tmp_path):
    # Non-finite gradients beside a finite loss are what a loss-scaling overflow looks like; the scaler used to be
    # left to deal with it (its scale halved, nothing reported). A forward activation cannot overflow from scaling.
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu")
    scales = {}

    class Scale(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            scales[trainer.global_step - 1] = scaler.get_scale()

    detector = NaNDetector(action="skip")
    trainer(tmp_path, [detector, Scale()], max_steps=5, plugins=[MixedPrecision("16-mixed", "cpu", scaler)]).fit(
        LossReadsSomeRows(forward_steps=(2,)), make_loader())
    assert [(e["step"], e["phase"], e["module"]) for e in detector.events] == [(2, "forward", "body.1")]
    assert detector.skipped_steps == 1
    assert scales[2] == scales[1]  # the detector's skip leaves the scaler as it was: it was no overflow


@pytest.mark.parametrize("spike_zscore", [None, 6.0], ids=["finite only", "with norms"])
def test_64_true_is_checked_in_fp64(tmp_path, spike_zscore):
    # fp64 gradients once made the check's fp32 norms raise; both ways of checking now name the module
    with pytest.raises(NonFiniteError) as info:
        trainer(tmp_path, [NaNDetector(spike_zscore=spike_zscore)], max_steps=4, precision="64-true").fit(
            TinyNet(forward_steps=(2,)), make_loader())
    assert (info.value.report["step"], info.value.report["module"]) == (2, "body.1")
    assert info.value.report["dtype"] == "float64"
