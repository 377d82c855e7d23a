"""Loss and gradient-norm spikes: detected in the step's one check, skipped with nothing lost, located, explained."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from helpers import TESTS, read_events
from torch.utils.data import DataLoader, TensorDataset
from zoo import CASES, SEQ, VOCAB, ZooModule

from lightning_opkit import NaNDetector
from lightning_opkit.nan.spike_report import top_jumps

#: the pattern converges in ~60 steps (loss near 0.005 on every case used here); the fault comes after
FAULT_STEP = 70
#: a healthy run long enough to judge 180 steps past the warm-up
STEPS = 200


class Steady(ZooModule):
    """A zoo model under a constant learning rate: the loss keeps falling instead of freezing with the LR."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


def _pattern(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` batches of 4 sequences counting up modulo 8 from random offsets: a pattern an LM learns."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 8, (n, 4, 1), generator=g) + torch.arange(SEQ)) % 8


def _loader(batches: torch.Tensor) -> DataLoader:
    ids = batches.reshape(-1, SEQ)
    return DataLoader(TensorDataset(ids, torch.zeros(len(ids), dtype=torch.long)), batch_size=4)


class Losses(pl.Callback):
    """Every step's loss, in order (a skipped step's too)."""

    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _fit(tmp_path, name, batches, detector, *extra, steps=None, **module_kwargs):
    torch.manual_seed(0)
    model = Steady(CASES[name], **module_kwargs)
    losses = Losses()
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps or len(batches), logger=pl.loggers.TensorBoardLogger(
        str(tmp_path), name="", version=""), callbacks=[detector, losses, *extra], enable_checkpointing=bool(extra) and
        any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in extra),
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), deterministic=True)
    trainer.fit(model, _loader(batches))
    return model, losses.losses


def test_a_corrupted_batch_is_skipped_and_the_run_goes_on_as_if_it_never_came(tmp_path):
    clean = _pattern(FAULT_STEP + 10)
    noise = torch.randint(0, VOCAB, (1, 4, SEQ), generator=torch.Generator().manual_seed(1))
    corrupted = torch.cat([clean[:FAULT_STEP], noise, clean[FAULT_STEP:]])
    detector = NaNDetector(action="skip", spike_zscore=6.0)
    spiked_model, spiked = _fit(tmp_path / "a", "torch_encoder", corrupted, detector)
    clean_model, losses = _fit(tmp_path / "b", "torch_encoder", clean, NaNDetector(action="skip", spike_zscore=6.0))

    assert spiked[FAULT_STEP] > 100 * max(spiked[FAULT_STEP - 5:FAULT_STEP])  # it is a spike (8.7 against ~0.005)
    [event] = detector.events
    assert (event["kind"], event["step"], event["batch_idx"], event["action"]) == ("spike", FAULT_STEP, FAULT_STEP,
                                                                                     "skip")
    assert event["zscore"] > 6.0
    assert event["loss"] == pytest.approx(spiked[FAULT_STEP], rel=1e-5)
    assert event["cause"] == "data_or_model"
    assert f"batch {FAULT_STEP}" in event["advice"]
    assert event["top_parameters"]
    assert all("x)" in p for p in event["top_parameters"])
    # nothing lost: every later step sees the weights and optimizer state of the run that never saw the batch
    assert spiked[:FAULT_STEP] == losses[:FAULT_STEP]
    assert spiked[FAULT_STEP + 1:] == losses[FAULT_STEP:]
    assert all(torch.equal(a, b) for a, b in zip(spiked_model.state_dict().values(),
                                                  clean_model.state_dict().values(), strict=True))
    assert detector.skipped_steps == 1
    assert detector.consecutive_skips == 0
    assert detector.state_dict()["spikes"]["count"] == len(clean)  # every good step entered the window, the spike not

    scalars, texts = read_events(str(tmp_path / "a"))
    assert scalars["opkit/nan/spikes"][-1][1] == 1
    assert scalars["opkit/nan/skipped_steps"][-1][1] == 1
    assert any("Loss spike at global step 70" in t for _, t in texts["opkit/nan/report"])
    assert "spikes (z > 6" in "\n".join(detector.summary_lines())


class OneTimeTimes30(pl.Callback):
    """Multiplies one module's output by 30 once, at one step's training forward: a flipped exponent bit."""

    def __init__(self, path: str, step: int):
        self.path, self.step, self.fired = path, step, False

    def on_fit_start(self, trainer, pl_module):
        self.handle = pl_module.model.get_submodule(self.path).register_forward_hook(self._hook)
        self.trainer = trainer

    def on_fit_end(self, trainer, pl_module):
        self.handle.remove()

    def _hook(self, module, args, output):
        if not self.fired and self.trainer.global_step == self.step:
            self.fired = True  # the replays of this step run clean, as they would on healthy hardware
            return output * 30
        return None


def test_a_one_time_activation_corruption_is_skipped_and_called_transient(tmp_path):
    batches = _pattern(FAULT_STEP + 5)
    detector = NaNDetector(action="skip", spike_zscore=6.0)
    model, losses = _fit(tmp_path, "hf_gpt2", batches, detector, OneTimeTimes30("transformer.h.0.attn.c_proj",
                                                                                 FAULT_STEP))
    [event] = detector.events
    assert (event["kind"], event["step"], event["cause"]) == ("spike", FAULT_STEP, "transient")
    assert "silent data corruption" in event["advice"]
    assert "device" in event["advice"]
    assert event["module"] is None  # a calm replay cannot show where it started
    assert losses[FAULT_STEP] > 100 * losses[FAULT_STEP - 1]
    assert max(losses[FAULT_STEP + 1:]) < 10 * losses[FAULT_STEP - 1]  # the bad update never happened



@pytest.mark.parametrize("name", sorted(CASES))
def test_no_false_alarm_over_a_healthy_run(tmp_path, name):
    # 16 batches an epoch, 12 epochs: the loss falls while the model memorizes, with the epoch's batches repeating
    torch.manual_seed(0)
    model = Steady(CASES[name], lr=1e-3)
    detector = NaNDetector(action="skip", spike_zscore=6.0)
    trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, callbacks=[detector],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(model, model.loader(n=64))
    assert detector.events == []
    spikes = detector.state_dict()["spikes"]
    assert spikes["judged"] == STEPS - 20  # every step past the warm-up was judged, none alarmed
    assert max(spikes["highest"]) < 6.0
    print(f"{name}: highest z of a good step: loss {spikes['highest'][0]:.2f}, grad {spikes['highest'][1]:.2f}")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_under_ddp_a_spike_on_one_rank_is_skipped_by_both_with_the_same_report(tmp_path, strategy):
    from test_ddp import run_two_ranks

    r0, r1 = run_two_ranks(os.path.join(TESTS, "ddp_spike_script.py"), tmp_path, strategy)
    assert r0["events"] == r1["events"]
    [event] = r0["events"]
    assert (event["step"], event["kind"], event["rank"], event["cause"]) == (FAULT_STEP, "spike", 1, "data_or_model")
    assert r0["skipped"] == r1["skipped"] == 1
    assert r1["losses"][FAULT_STEP] > 100 * r1["losses"][FAULT_STEP - 1]  # only rank 1 saw the bad batch
    assert r0["losses"][FAULT_STEP] < 2 * r0["losses"][FAULT_STEP - 1]
    assert r0["weights"] == r1["weights"]  # both left the step out: still in lockstep


def test_the_window_is_checkpointed_and_a_resumed_run_goes_on_judging_against_it(tmp_path):
    batches = _pattern(60)
    first = NaNDetector(action="skip", spike_zscore=6.0)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    _fit(tmp_path / "a", "torch_encoder", batches, first, checkpoint, steps=30)
    saved = first.state_dict()["spikes"]
    assert saved["count"] == 30
    assert saved["judged"] == 10  # past the 20-step warm-up

    resumed = NaNDetector(action="skip", spike_zscore=6.0)
    torch.manual_seed(0)
    model = Steady(CASES["torch_encoder"])
    trainer = pl.Trainer(accelerator="cpu", max_steps=40, logger=False, callbacks=[resumed],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path / "b"))
    trainer.fit(model, _loader(batches), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    spikes = resumed.state_dict()["spikes"]
    assert spikes["count"] == 40
    assert spikes["judged"] == 20  # judged from its first step on: no second warm-up
    assert spikes["values"][:30] == saved["values"]


class Times30InBf16(pl.Callback):
    """On one batch, multiplies one module's output by 30 whenever it comes out in bf16: a fault of the low precision.

    Unlike :class:`OneTimeTimes30` it fires in every run of that batch, the replays included, and only in bf16, as a
    batch that overflows a bf16 accumulation would; the same weights on another batch run clean.
    """

    def __init__(self, path: str, batch: torch.Tensor):
        self.path, self.batch, self.current = path, batch, None

    def on_fit_start(self, trainer, pl_module):
        self.handles = [pl_module.model.register_forward_pre_hook(self._seen, with_kwargs=True),
                        pl_module.model.get_submodule(self.path).register_forward_hook(self._hook)]

    def on_fit_end(self, trainer, pl_module):
        for handle in self.handles:
            handle.remove()

    def _seen(self, module, args, kwargs):
        self.current = args[0] if args else kwargs.get("input_ids")

    def _hook(self, module, args, output):
        bad = self.current is not None and self.current.shape == self.batch.shape and torch.equal(self.current,
                                                                                                  self.batch)
        return output * 30 if bad and output.dtype == torch.bfloat16 else None


def test_a_spike_only_in_bf16_is_called_precision_and_its_module_named(tmp_path):
    from lightning_opkit import PrecisionPolicy

    batches = _pattern(FAULT_STEP + 5)
    detector = NaNDetector(action="skip", spike_zscore=6.0)
    policy = PrecisionPolicy(rules={"matmul": "bf16"}, measure=False, census_every_n_steps=0)
    model, losses = _fit(tmp_path, "hf_gpt2", batches, detector, policy,
                         Times30InBf16("transformer.h.0.attn.c_proj", batches[FAULT_STEP]))
    [event] = detector.events
    assert (event["kind"], event["step"], event["cause"]) == ("spike", FAULT_STEP, "precision"), event
    assert "transformer.h.0.attn" in (event["module"] or ""), event
    # and repaired as a precision NaN is: the module it starts in runs in fp32 from the next step on
    assert event["repair"] is not None
    assert event["repair"].startswith(event["module"]), event["repair"]
    assert any("repaired (pinned to fp32" in line for line in detector.summary_lines())
    assert losses[FAULT_STEP] > 10 * losses[FAULT_STEP - 1]
    assert max(losses[FAULT_STEP + 1:]) < 10 * losses[FAULT_STEP - 1]  # skipped: the bad update never happened


def test_the_parameters_whose_gradients_jumped_most_are_named_a_non_finite_jump_first():
    norms = torch.tensor([1.0, 30.0, float("inf"), 2.0])
    running = torch.tensor([1.0, 1.0, 1.0, 0.1])
    assert top_jumps(norms, running, ["a", "b", "c", "d"], n=3)[0].startswith("c (")
    assert [j.split()[0] for j in top_jumps(norms, running, ["a", "b", "c", "d"], n=4)] == ["c", "b", "d", "a"]
    assert top_jumps(norms, torch.ones(3), ["a", "b", "c", "d"]) == ()  # a parameter set that changed: no claim
    assert top_jumps(norms, None, ["a", "b", "c", "d"]) == ()
