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
                                dict(modules=["body"], save=["matmul"], measure=True, measure_steps=1)),
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
           "ActivationCheckpointing": ("measure_steps", "0")}[name]
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
    trainer(tmp_path, callbacks, max_steps=6).fit(model, make_loader())
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
    assert callbacks[4].price is not None


def test_whole_step_arguments_parse_from_the_cli():
    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[Callback])
    cfg = parser.parse_args(["--callbacks+=lightning_opkit.PrecisionPolicy", "--callbacks.rules=auto",
                             "--callbacks.whole_step=false", "--callbacks.trial_rounds=3"])
    policy = parser.instantiate_classes(cfg).callbacks[0]
    assert (policy.rules, policy.whole_step, policy.trial_rounds) == ("auto", False, 3)


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
    "ActivationCheckpointing": (ActivationCheckpointing, dict(modules=["body"], measure_steps=1),
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
