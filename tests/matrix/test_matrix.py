"""Every combination a user can configure: the callbacks alone, in pairs and all five, under each optimization mode,
precision and compile mode (the cases and how they were chosen: ``cases.py``).

Each case trains a zoo model for six steps, with a NaN written into a deep module's output at step 2 where the set has
a NaNDetector (``action="skip"``), and a checkpoint saved at step 4. It checks invariants, not snapshots:

- the fit finishes and every loss but the poisoned one is finite;
- the model is exactly as before (hooks, patched methods, function modes, ``state_dict`` keys);
- with a NaNDetector, the fault is reported once, at step 2, naming the module, with cause ``data_or_model``, and
  the step is skipped;
- the weights and losses equal a reference run that never saw the poisoned batch: a plain run (no callback) where
  every callback in the set is numerics-neutral (ActivationCheckpointing, TorchCompile's ``eager`` backend,
  NaNDetector, ProfilerWindows), else a run with the set's PrecisionPolicy alone; bit for bit, except where
  :data:`TOLERANCE` says why not (a compiled policy, Inductor);
- resuming from the step-4 checkpoint, with fresh callbacks, ends on the same weights as the uninterrupted run;
- with ``logger=False`` no file is written under the run's directory (traces included); with a TensorBoardLogger the
  run summary is there, and nothing of a callback that is off;
- a callback turned off changes nothing: the expectations are those of the set without it;
- where it compiles, dynamo's own recompile log holds no recompile a module hook caused (an opkit hook traced into a
  region recompiles it each window);
- the kit's account agrees with an independent observer (``tests/observer.py``, no code shared with opkit): the event
  directories and traces on disk are those the run summary names; where nothing is compiled (dynamo compiles nothing
  under a dispatch mode), every GEMM kernel is watched at the dispatcher, and the float8 modules of the policy table
  are exactly those whose kernels took float8 inputs, and the last census's GEMM calls per dtype are those kernels.

A few cases run TorchCompile's Inductor backend (marked slow).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import re

import lightning.pytorch as pl
import pytest
import torch
from cases import CASES, Case
from helpers import REFUSED, SaveAt, policy_refused_under, read_events, snapshot
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from observer import DynamoRecompiles, GemmObserver, RangeObserver, StepMark, event_dirs, trace_files
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader
from zoo import CASES as ZOO
from zoo import ZooModule

from lightning_opkit import (
    ActivationCheckpointing,
    NaNDetector,
    PrecisionPolicy,
    ProfilerWindows,
    TorchCompile,
)
from lightning_opkit.precision.decide import Decision
from lightning_opkit.precision.fp8 import gemm_dims
from lightning_opkit.precision.plan import Plan

STEPS, FAULT, SAVE = 6, 2, 4


class ManualZoo(ZooModule):
    """The zoo module under manual optimization: its step zeroes, backpropagates, steps and schedules itself."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt, sched = self.optimizers(), self.lr_schedulers()
        loss = self(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        sched.step()
        self.log("train_loss", loss)
        return loss


class Losses(pl.Callback):
    def __init__(self):
        self.by_batch: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.by_batch[batch_idx] = float(loss)


#: each letter's area, as in its tags and in OPKIT_DISABLE
AREA = {"P": "precision", "N": "nan", "W": "profiler", "C": "compile", "A": "checkpointing"}


def _auto_fp8_policy(case: Case, **kw) -> PrecisionPolicy:
    """``rules="auto"`` with a decision that runs every Linear in float8, as a run on a GPU would have checkpointed it.

    A CPU measures float8 many times slower (a reference kernel), and a measured choice would differ between the runs
    compared here; the decision is brought in the policy's state, as a resumed fit brings it.
    """
    policy = PrecisionPolicy(census_every_n_steps=3, rules="auto", trial_steps=0, **kw)
    linears = [n for n, m in ZooModule(case.model).named_modules() if gemm_dims(m) is not None]
    measured = Decision("matmul", "fp8", "measured on a GPU")
    policy.load_state_dict({"plan": Plan({"matmul": Decision("matmul", "bf16", "measured on a GPU")},
                                         fp8=dict.fromkeys(linears, measured)).state()})
    return policy


def _callbacks(case: Case, letters: str, backend: str = "eager", fp8: str = "") -> list[pl.Callback]:
    blocks = ["model." + ZOO[case.model].blocks]
    made: list[pl.Callback] = []
    for letter in letters:
        # the callback turned off: enabled=False under automatic optimization (OPKIT_DISABLE, set by the test, under
        # manual)
        kw = dict(enabled=False) if letter == case.off and case.optimization == "automatic" else {}
        if letter == "P" and fp8 == "auto":
            made.append(_auto_fp8_policy(case, **kw))
        elif letter == "P":
            # the default table, or its GEMMs in float8
            made.append(PrecisionPolicy(census_every_n_steps=3, rules={"matmul": "fp8"} if fp8 else None, **kw))
        elif letter == "N":
            made.append(NaNDetector(action="skip", **kw))
        elif letter == "W":
            # traces exported without a logger would break the no-file rule: exported where a logger takes them
            # named ranges in each window; the graph where all five run (an export per fit: kept to those cases). Two
            # active steps: the first is probed for memory (and is the census's) and runs eagerly, the second runs
            # compiled with the window's ranges attached, where a hook traced into a region would recompile it
            made.append(ProfilerWindows(every_n_steps=3, warmup=0, active=2, memory_breakdown=True,
                                        roofline=letters == "PNWCA", export_trace=case.logging == "none",
                                        ranges="windows", graph=letters == "PNWCA", **kw))
        elif letter == "C":
            made.append(TorchCompile(backend=backend, modules=blocks if case.compile == "regional" else None,
                                     fallback=False, **kw))
        elif letter == "A":
            made.append(ActivationCheckpointing(modules=blocks, measure=True, trial_steps=1, **kw))
    assert [c.enabled for c in made] == [letter != case.off for letter in letters]
    return made


def _precision(case: Case) -> dict:
    if case.precision == "16-mixed":
        return dict(plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))])
    return dict(precision=case.precision)


def _fit(root, case: Case, callbacks, batches, steps, faults=None, save=None, ckpt=None, logger=False, observe=False):
    torch.manual_seed(0)
    model = (ManualZoo if case.optimization == "manual" else ZooModule)(case.model, faults=faults)
    before = snapshot(model)
    losses = Losses()
    extra = [SaveAt(SAVE, save)] if save is not None else []
    # dynamo compiles nothing under a dispatch mode: a case that compiles is watched on the file system only
    observer = GemmObserver(model) if observe and "C" not in case.active else None
    ranges = RangeObserver() if observer is not None else None  # sys.setprofile: not beside dynamo either
    # where it compiles, dynamo's own recompile log: no opkit hook may be traced into a region (each window's would
    # recompile it, until dynamo's limit sends it to eager)
    recompiles = DynamoRecompiles() if "C" in case.active else None
    if observer is not None:
        extra.append(StepMark(observer))
    trainer = pl.Trainer(default_root_dir=str(root), max_steps=steps, accelerator="cpu", devices=1, logger=logger,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[*callbacks, losses, *extra],
                         **_precision(case))
    printed = io.StringIO()
    nothing = contextlib.nullcontext
    with contextlib.redirect_stdout(printed), observer or nothing(), ranges or nothing(), recompiles or nothing():
        trainer.fit(model, DataLoader(batches, batch_size=None), ckpt_path=ckpt)
    assert snapshot(model) == before, "the model is not as it was"
    assert recompiles is None or not recompiles.on_hooks(), recompiles.messages
    if observe:
        _agrees_with_the_observer(root, case, callbacks, observer, printed.getvalue(), ranges)
    return model, trainer, losses.by_batch


def _agrees_with_the_observer(root, case: Case, callbacks, observer: GemmObserver | None, printed: str,
                              ranges: RangeObserver | None = None) -> None:
    """The summary's log locations, graph and ranges, the policy table's float8 modules and the census against what
    was observed."""
    if not case.active:
        return  # no opkit callback acts: no summary
    named = re.findall(r"tensorboard --logdir (\S+)", printed)
    assert sorted(named) == event_dirs(root), printed
    windows = next((c for c in callbacks if isinstance(c, ProfilerWindows) and c.enabled), None)
    if windows is not None and windows.graph:
        graphs = []
        for folder in event_dirs(root):
            accumulator = EventAccumulator(folder)
            accumulator.Reload()
            graphs += [folder] if accumulator.Tags()["graph"] else []
        drawn = "graph: drawn" in printed
        assert drawn == bool(graphs), printed  # the summary says it is in the Graphs tab exactly when it is
        assert drawn or "graph: not drawn (" in printed, printed  # else why not
    if ranges is not None:
        assert ranges.balanced()
        pushed = windows.range_marks.pushed if windows is not None and windows.range_marks is not None else 0
        assert len(ranges.names) == pushed
        assert bool(pushed) == (windows is not None and windows.windows_done > 0)
    assert bool(named) != ("logs: none" in printed), printed
    said = re.search(r"(\d+) trace file\(s\)", printed)
    assert (int(said.group(1)) if said else 0) == len(trace_files(root)), printed
    policy = next((c for c in callbacks if isinstance(c, PrecisionPolicy) and c.enabled), None)
    if observer is None or policy is None:
        return
    ran_fp8 = {module for _, module, _, dtype in observer.records if dtype == "fp8"}
    assert ran_fp8 == set(policy.fp8.converted)
    assert not ran_fp8 & set(policy.fp8.skipped)
    # the last census: its GEMM calls per dtype are the kernels of that step's forward, outside attention modules
    # (nn.MultiheadAttention is one attention op to the census, its GEMMs inside it)
    last = (STEPS - 1) // policy.census_every_n_steps * policy.census_every_n_steps
    attention = {n for n, m in _named(observer) if isinstance(m, torch.nn.MultiheadAttention)}
    seen: dict[str, int] = {}
    for module, cls, dtype in observer.at(last):
        if cls == "matmul" and not any(module == a or module.startswith(a + ".") for a in attention):
            seen[dtype] = seen.get(dtype, 0) + 1
    counted = {dtype: row["calls"] for (cls, dtype), row in policy.census.items() if cls == "matmul"}
    assert counted == seen, (counted, seen)


def _named(observer: GemmObserver):
    return observer.modules


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


#: how close two runs that should agree must be: bit for bit; a compiled policy (dynamo's graph of the same casts,
#: not always the same kernels): 1e-5; Inductor (fused kernels round differently, and a resumed run compiles afresh):
#: 2% on the losses, as the zoo's own Inductor tests allow, and the weights not element by element (AdamW turns the
#: rounding noise of a gradient that is zero in exact arithmetic, an attention key bias's, into lr-sized steps of
#: either sign) but by what they compute: the trained models' losses on a batch, 2% apart at most
TOLERANCE = {"exact": None, "compiled policy": dict(rtol=1e-5, atol=1e-6), "inductor": dict(rtol=2e-2, atol=0)}


def _same(a: pl.LightningModule, b: pl.LightningModule, how: str, batch) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    if how == "inductor":
        with torch.no_grad():
            torch.testing.assert_close(a.eval()(batch).float(), b.eval()(batch).float(), **TOLERANCE[how])
        return
    for key in wa:
        if TOLERANCE[how] is None:
            assert torch.equal(wa[key], wb[key]), key
        else:
            torch.testing.assert_close(wa[key], wb[key], **TOLERANCE[how], msg=lambda m, key=key: f"{key}: {m}")


def _same_losses(ours: list[float], theirs: list[float], how: str) -> None:
    if TOLERANCE[how] is None:
        assert ours == theirs
    else:
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), **{**TOLERANCE[how], "atol": 0})


def _check_files(root, case: Case) -> None:
    """No file without a logger; with TensorBoard, the summary, and nothing of the callback that is off."""
    if case.logging == "none":
        assert [p for p in root.rglob("*") if p.is_file()] == [], "logger=False, yet files were written"
        return
    scalars, texts = read_events(str(root))
    tags = [*scalars, *texts]
    assert ("opkit/summary" in texts) == bool(case.active), tags
    if case.off:
        areas = ("profiler", "memory") if case.off == "W" else (AREA[case.off],)
        assert not [t for t in tags if t.startswith(tuple(f"opkit/{a}/" for a in areas))], tags


def _check(tmp_path, case: Case, backend: str = "eager", fp8: str = "") -> None:
    batches = list(ZooModule(case.model).loader(n=64))[:STEPS]
    detecting = "N" in case.active
    faults = {"forward": FAULT} if detecting else None
    callbacks = _callbacks(case, case.callbacks, backend, fp8)
    logger = TensorBoardLogger(str(tmp_path / "run")) if case.logging == "tensorboard" else False
    model, trainer, losses = _fit(tmp_path / "run", case, callbacks, batches, STEPS, faults, save=tmp_path / "mid.ckpt",
                                  logger=logger, observe=True)
    _check_files(tmp_path / "run", case)

    # it finished, and trained on every batch it should have
    assert trainer.global_step == STEPS
    assert sorted(losses) == list(range(STEPS))
    assert all(math.isfinite(v) for b, v in losses.items() if not (detecting and b == FAULT)), losses

    if fp8:  # every GEMM module of the model runs in float8, whatever else was attached, or is named with why not
        policy = next(c for c in callbacks if isinstance(c, PrecisionPolicy))
        assert policy.fp8.converted
        gemms = {n for n, m in model.named_modules() if gemm_dims(m) is not None}
        assert gemms == {*policy.fp8.converted, *policy.fp8.skipped}
        # only nn.MultiheadAttention's out_proj, whose weight the attention reads without calling its forward
        assert {n.rpartition(".")[2] for n in policy.fp8.skipped} <= {"out_proj"}, policy.fp8.skipped
        assert (fp8 == "auto") == bool(policy.fp8.by_auto)
    if detecting:
        detector = next(c for c in callbacks if isinstance(c, NaNDetector))
        assert [(e["step"], e["phase"], e["module"], e["cause"], e["action"]) for e in detector.events] == [
            (FAULT, "forward", "model." + ZOO[case.model].deep, "data_or_model", "skip")]
        assert detector.skipped_steps == 1


    # the same weights as a run that never saw the poisoned batch, with only what changes numerics attached
    kept = [b for i, b in enumerate(batches) if not (detecting and i == FAULT)]
    numerics = "P" if "P" in case.active else ""
    reference, _, reference_losses = _fit(tmp_path / "reference", case, _callbacks(case, numerics, fp8=fp8), kept,
                                          len(kept))
    how = "inductor" if backend == "inductor" else "compiled policy" if {"P", "C"} <= set(case.active) else "exact"
    _same(model, reference, how, batches[0])
    ours = [v for b, v in sorted(losses.items()) if not (detecting and b == FAULT)]
    _same_losses(ours, [v for _, v in sorted(reference_losses.items())], how)

    # resumed from the mid-run checkpoint with fresh callbacks: the same end
    resumed, resumed_trainer, _ = _fit(tmp_path / "resumed", case, _callbacks(case, case.callbacks, backend, fp8),
                                       batches[SAVE:], STEPS, faults, ckpt=tmp_path / "mid.ckpt")
    assert resumed_trainer.global_step == STEPS
    _same(resumed, model, "inductor" if backend == "inductor" else "exact", batches[0])


def _switch(monkeypatch, case: Case) -> None:
    if case.off and case.optimization == "manual":
        monkeypatch.setenv("OPKIT_DISABLE", AREA[case.off])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_combination(tmp_path, monkeypatch, case):
    _switch(monkeypatch, case)
    _check(tmp_path, case)


#: the policy with its GEMMs in float8, once per callback set that has it (every callback on), on the zoo's Llama,
#: GPT-2 (their GEMMs all take float8) and nn.TransformerEncoder (whose attention's out_proj float8 cannot take);
#: under 16-mixed a bf16 glue beside fp16 autocast is refused, so those cases run bf16-mixed
FP8 = [dataclasses.replace(c, model=("hf_llama", "hf_gpt2", "torch_encoder")[i % 3],
                           precision="bf16-mixed" if c.precision == "16-mixed" else c.precision)
       for i, c in enumerate({c.callbacks: c for c in reversed(CASES) if "P" in c.callbacks and c.switch == "on"}
                             .values())]


@pytest.mark.parametrize("case", FP8, ids=[c.id for c in FP8])
def test_combination_with_fp8_gemms(tmp_path, monkeypatch, case):
    _switch(monkeypatch, case)
    _check(tmp_path, case, fp8="rules")


#: rules="auto" running the float8 modules it chose, with every callback (compiled whole, checkpointed)
AUTO_FP8 = [c for c in FP8 if c.callbacks == "PNWCA"]


@pytest.mark.parametrize("case", AUTO_FP8, ids=[c.id for c in AUTO_FP8])
def test_combination_with_auto_chosen_fp8_gemms(tmp_path, monkeypatch, case):
    _switch(monkeypatch, case)
    _check(tmp_path, case, fp8="auto")


SLOW = [c for c in CASES if c.callbacks == "PNWCA"][:2] + [c for c in CASES if c.callbacks == "CA"][:1]


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=[c.id for c in SLOW])
def test_combination_under_inductor(tmp_path, monkeypatch, case):
    _switch(monkeypatch, case)
    if {"P", "C"} <= set(case.active) and policy_refused_under("inductor"):
        with pytest.raises(ValueError, match=REFUSED):
            _check(tmp_path, case, backend="inductor")
        return
    _check(tmp_path, case, backend="inductor")
