"""What every opkit callback promises: defaults construct, CLI round trip, two fits, double teardown, clean model."""

import pytest
import torch
from helpers import TinyNet, make_loader, snapshot, trainer
from jsonargparse import ArgumentParser
from lightning.pytorch import Callback

from lightning_opkit import ActivationCheckpointing, NaNDetector, PrecisionPolicy, ProfilerWindows, TorchCompile
from lightning_opkit.core.torch_compat import COMPILES_UNDER_SELECTIVE_CHECKPOINT

CALLBACKS = {
    "PrecisionPolicy": (PrecisionPolicy, dict(rules={"norm": "fp32"}, overrides={"head": "fp32"},
                                              census_every_n_steps=2)),
    "NaNDetector": (NaNDetector, dict(action="skip", every_n_steps=2, modules=["body.*"])),
    "ProfilerWindows": (ProfilerWindows, dict(every_n_steps=3, warmup=0, active=2, keep_traces=1, roofline=True)),
    "TorchCompile": (TorchCompile, dict(backend="eager", modules=["body"], dynamic=False)),
    "ActivationCheckpointing": (ActivationCheckpointing,
                                dict(modules=["body"], save=["matmul"], measure=True, trial_steps=1)),
}


@pytest.mark.parametrize("name", list(CALLBACKS))
def test_constructible_from_defaults(name):
    assert isinstance(CALLBACKS[name][0](), Callback)


@pytest.mark.parametrize("name", list(CALLBACKS))
def test_lightning_cli_class_path_round_trip(name):
    cls, kwargs = CALLBACKS[name]
    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    config = {"callbacks": [{"class_path": f"lightning_opkit.{name}", "init_args": kwargs}]}
    cfg = parser.parse_object(config)
    callback = parser.instantiate_classes(cfg).callbacks[0]
    assert type(callback) is cls
    for key, value in kwargs.items():
        assert getattr(callback, key) == value


@pytest.mark.parametrize("name", list(CALLBACKS))
def test_cli_rejects_a_bad_value_naming_it(name, capsys):
    bad = {"PrecisionPolicy": ("default", "half"), "NaNDetector": ("action", "ignore"),
           "ProfilerWindows": ("active", "0"), "TorchCompile": ("backend", "inductr"),
           "ActivationCheckpointing": ("trial_steps", "0")}[name]
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--callbacks", type=list[Callback])
    with pytest.raises(Exception, match=bad[0]):
        parser.instantiate_classes(
            parser.parse_args([f"--callbacks+=lightning_opkit.{name}", f"--callbacks.{bad[0]}={bad[1]}"]))


@pytest.mark.parametrize("name", list(CALLBACKS))
def test_two_fits_double_teardown_and_an_untouched_model(tmp_path, name):
    cls, kwargs = CALLBACKS[name]
    callback = cls(**kwargs)
    model = TinyNet()
    before = snapshot(model)
    for i in range(2):
        t = trainer(tmp_path / str(i), [callback], max_steps=4)
        t.fit(model, make_loader())
        assert snapshot(model) == before
    callback.teardown(t, model, "fit")
    callback.on_exception(t, model, RuntimeError("again"))
    assert snapshot(model) == before
    assert torch._C._len_torch_function_stack() == 0
    assert not torch.autograd.profiler._is_profiler_enabled


def test_all_together(tmp_path, recwarn):
    callbacks = [cls(**kwargs) for cls, kwargs in CALLBACKS.values()]
    model = TinyNet(forward_steps=(2,))
    before = snapshot(model)
    # 26 steps: the checkpointing price begins after TorchCompile's eager-against-compiled calls (one timed trial at a
    # time), and neither takes a sample on the policy's census steps (every second one here)
    trainer(tmp_path, callbacks, max_steps=26).fit(model, make_loader(n=208))
    assert snapshot(model) == before
    assert [e["step"] for e in callbacks[1].events] == [2]
    assert callbacks[1].events[0]["module"] == "body.1"
    assert callbacks[2].windows_done >= 1
    said = [str(w.message) for w in recwarn if "compiles nothing inside a selective checkpoint" in str(w.message)]
    if COMPILES_UNDER_SELECTIVE_CHECKPOINT:
        assert callbacks[3].watch.frames >= 1
        assert said == []
    else:  # torch 2.9: the selectively checkpointed block runs eagerly, and the user is told so once
        assert callbacks[3].watch.frames == 0
        assert len(said) == 1
    assert callbacks[4].checkpointed == ["body"]
    price = callbacks[4].price
    assert price is not None
    line = callbacks[4].summary_lines()[0]
    # keeping the GEMMs' outputs of so small a block saves more than the block's input alone: said as more, not as a
    # negative "less"
    assert ("more: it keeps more than it frees" in line) == (price.saved_with > price.saved_without), line
    assert "(-" not in line, line


def test_whole_step_arguments_parse_from_the_cli():
    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    cfg = parser.parse_args(["--callbacks+=lightning_opkit.PrecisionPolicy", "--callbacks.rules=auto",
                             "--callbacks.whole_step=false", "--callbacks.trial_steps=3"])
    policy = parser.instantiate_classes(cfg).callbacks[0]
    assert (policy.rules, policy.whole_step, policy.trial_steps) == ("auto", False, 3)


@pytest.mark.parametrize("cls", [NaNDetector, TorchCompile, ActivationCheckpointing])
def test_an_empty_module_list_is_refused_alike(cls):
    with pytest.raises(ValueError, match=r"^`modules` is an empty list, which would match no module; use None"):
        cls(modules=[])


def test_an_unknown_operator_class_is_named_with_the_valid_ones():
    valid = r"\['matmul', .*'other'\]"
    got = r"'nosuch' in \['nosuch'\]"
    with pytest.raises(ValueError, match=rf"^Expected `save` to list items of {valid}, but got {got}$"):
        ActivationCheckpointing(save=["nosuch"])


#: each callback's ``measure``, with whatever acts on a measurement switched off, and what it reports when it measured
MEASURING = {
    "PrecisionPolicy": (PrecisionPolicy, dict(rules={"matmul": "bf16"}, census_every_n_steps=0),
                        lambda cb: cb.measurements is not None),
    "TorchCompile": (TorchCompile, dict(backend="eager", modules=["body"], eager_if_slower=False),
                     lambda cb: cb.regions["body"].speedup is not None),
    "ActivationCheckpointing": (ActivationCheckpointing, dict(modules=["body"], trial_steps=1),
                                lambda cb: cb.price is not None),
}


@pytest.mark.parametrize("name", list(MEASURING))
def test_measure_has_one_meaning_it_times_and_reports_and_never_changes_what_trains(tmp_path, name):
    """Issue 52: ``measure`` means the same on every callback. It times the alternative once and reports it; what
    acts on a measurement has its own argument (TorchCompile's ``eager_if_slower``; ``rules="auto"``, whose purpose is
    deciding), so with that off, the weights after training are those of ``measure=False``, bit for bit."""
    cls, kwargs, reported = MEASURING[name]
    weights = {}
    for measure in (False, True):
        torch.manual_seed(0)
        model = TinyNet()
        callback = cls(measure=measure, **kwargs)
        trainer(tmp_path / str(measure), [callback], max_steps=12).fit(model, make_loader(n=96))
        assert reported(callback) == measure
        weights[measure] = {k: v.clone() for k, v in model.state_dict().items()}
    assert weights[True].keys() == weights[False].keys()
    assert all(torch.equal(weights[True][k], weights[False][k]) for k in weights[False])


class _Unprotected(Callback):
    """The training steps that ran without ActivationCheckpointing's recompute on ``module``: its forward began once
    in the step, not twice (a pre-hook of the test's own; the checkpoint calls the module's own forward)."""

    def __init__(self, path):
        self.path, self.calls, self._handle = path, [], None

    def on_train_start(self, trainer, pl_module):
        self._handle = pl_module.get_submodule(self.path).register_forward_pre_hook(lambda m, a: self._count())

    @torch.compiler.disable  # inside a compiled region: its list would be a guard of the test's own
    def _count(self):
        self.calls[-1] += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.calls.append(0)

    def on_train_end(self, trainer, pl_module):
        self._handle.remove()

    def steps(self):
        return [i for i, n in enumerate(self.calls) if n < 2]


def test_one_timed_trial_at_a_time_the_policys_contenders_then_the_checkpointing_price(tmp_path):
    """The policy's contender tables and ActivationCheckpointing's steps without its recompute both time the fit's
    own steps: run together, each timed the other (a table's step with or without the recompute). The price now waits
    for the policy's trial: the contenders run on steps 1-6 exactly as alone, and every step without the recompute
    comes after them."""
    from precision.test_auto import _row
    from precision.test_candidates import Chosen, Trialled

    rows = [_row("matmul", speed=0.4, loss=None, cos=None), _row("activation", speed=0.5, loss=None, cos=None),
            _row("norm", speed=1.3, loss=None, cos=None), _row("pointwise", speed=1.2, loss=None, cos=None)]
    alone = Trialled()
    trainer(tmp_path / "alone", [Chosen(rows, "per-class", others_ms=95.0, autocast_ms=150.0,
                                        census_every_n_steps=0, trial_steps=2)], max_steps=12).fit(alone,
                                                                                                  make_loader(n=96))
    model = Trialled()
    policy = Chosen(rows, "per-class", others_ms=95.0, autocast_ms=150.0, census_every_n_steps=0, trial_steps=2)
    checkpointing = ActivationCheckpointing(modules=["inner"], measure=True, trial_steps=1)
    unprotected = _Unprotected("inner.0")
    trainer(tmp_path / "both", [policy, checkpointing, unprotected], max_steps=12).fit(model, make_loader(n=96))
    assert model.per_step[:7] == alone.per_step[:7]  # the contenders' steps, undisturbed
    assert "confirmed on training steps" in policy.choice.trial or "best of 2" in policy.choice.trial
    assert unprotected.steps() == [8, 10]  # counted (7 with, 8 without), then timed (9 with, 10 without)
    assert checkpointing.price is not None


def test_the_checkpointing_price_waits_for_torch_compiles_eager_against_compiled(tmp_path):
    """TorchCompile times a region eager against compiled on its first calls (C E E C C E after two warm-ups); steps
    with and without the recompute taking turns beside them would make the compiled calls the checkpointed ones."""
    model = TinyNet()
    compiled = TorchCompile(backend="eager", modules=["body"])
    checkpointing = ActivationCheckpointing(modules=["body"], measure=True, trial_steps=1)
    unprotected = _Unprotected("body.0")
    trainer(tmp_path, [compiled, checkpointing, unprotected], max_steps=14).fit(model, make_loader(n=112))
    assert compiled.regions["body"].speedup is not None
    assert unprotected.steps()
    assert min(unprotected.steps()) >= 8  # after the region's 8 timed and warm-up calls
    assert checkpointing.price is not None


def test_the_checkpointing_price_takes_no_sample_on_a_census_step(tmp_path):
    """A census step recomputes every op in fp32: the policy's own trial takes no sample there, and neither does the
    checkpointing price now (a census step among the steps without the recompute made them look slower)."""
    model = TinyNet()
    policy = PrecisionPolicy(census_every_n_steps=2, measure=False)
    checkpointing = ActivationCheckpointing(modules=["body"], measure=True, trial_steps=2)
    unprotected = _Unprotected("body.0")
    trainer(tmp_path, [policy, checkpointing, unprotected], max_steps=16).fit(model, make_loader(n=128))
    assert checkpointing.price is not None
    assert unprotected.steps() == [5, 9, 11]  # the counted step without it (5), then timed: with 7, without 9 and 11


def test_a_compiled_region_called_only_without_grad_holds_no_trial_back(tmp_path):
    """TorchCompile times a region on its training calls (grad on); a region only ever called under no_grad (a frozen
    part of the model) never begins its trial, and must not keep the checkpointing price waiting for it."""

    class FrozenHead(TinyNet):
        def forward(self, x):
            with torch.no_grad():
                x = self.frozen(x)
            return super().forward(x)

        def __init__(self):
            super().__init__()
            self.frozen = torch.nn.Linear(8, 8)

    model = FrozenHead()
    compiled = TorchCompile(backend="eager", modules=["frozen"])
    checkpointing = ActivationCheckpointing(modules=["body"], measure=True, trial_steps=1)
    trainer(tmp_path, [compiled, checkpointing], max_steps=8).fit(model, make_loader())
    assert compiled.regions["frozen"].calls >= 8
    assert compiled.regions["frozen"].speedup is None  # never timed
    assert checkpointing.price is not None
