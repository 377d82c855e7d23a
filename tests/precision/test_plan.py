"""A rules="auto" decision kept for later: a resumed fit runs the checkpoint's decision without measuring, and the
arguments the summary prints run it in the next run without measuring at all (precision/plan.py)."""

import pytest
import torch
import yaml
from helpers import make_loader, read_events, snapshot, trainer

from lightning_opkit import PrecisionPolicy
from lightning_opkit.precision.decide import Decision
from lightning_opkit.precision.plan import Plan, pinned_arguments
from precision.test_policy import Probe


def _auto_fit(tmp_path, steps=3):
    torch.manual_seed(0)
    model = Probe()
    policy = PrecisionPolicy(rules="auto", census_every_n_steps=0, trial_steps=0)
    run = trainer(tmp_path, [policy], max_steps=steps)
    run.fit(model, make_loader())
    return run, policy, model


def test_a_resumed_fit_runs_the_checkpoints_decision_without_measuring(tmp_path):
    run, first, _ = _auto_fit(tmp_path / "first")
    assert first.measurements is not None
    path = str(tmp_path / "auto.ckpt")
    run.save_checkpoint(path)
    resumed = PrecisionPolicy(rules="auto", census_every_n_steps=0, trial_steps=0)
    run = trainer(tmp_path / "resumed", [resumed], max_steps=5, max_epochs=3)
    run.fit(Probe(), make_loader(), ckpt_path=path)
    assert run.global_step == 5  # it trained on
    assert resumed.measurements is None  # nothing measured in the resumed fit
    assert resumed.table == first.table
    assert {c: d.dtype for c, d in resumed.decisions.items()} == {c: d.dtype for c, d in first.decisions.items()}
    assert all(d.reason.endswith("(measured before the checkpoint)") for d in resumed.decisions.values())


def test_a_checkpoint_of_explicit_rules_carries_no_decision(tmp_path):
    fixed = PrecisionPolicy(rules={"matmul": "bf16"}, census_every_n_steps=0, measure=False)
    trainer(tmp_path, [fixed], max_steps=2).fit(Probe(), make_loader())
    assert fixed.state_dict() == {}
    assert fixed.decision_as_arguments() is None


def test_the_printed_arguments_run_the_same_decision_in_the_next_run_unmeasured(tmp_path, capsys):
    _, auto, measured = _auto_fit(tmp_path / "auto")
    printed = capsys.readouterr().out
    again = auto.decision_as_arguments()
    assert f"to run this decision again without measuring: {again}" in printed
    _, texts = read_events(str(tmp_path / "auto"))
    assert texts["opkit/precision/decision"][-1][1].endswith(f"`{again}`")
    if not again.startswith("PrecisionPolicy("):  # plain autocast won: what to run instead is bf16-mixed
        assert again.startswith("Trainer(precision='")
        return
    pinned = eval(again, {"PrecisionPolicy": PrecisionPolicy})  # what a user pastes into their script
    pinned.census_every_n_steps = 0
    torch.manual_seed(0)
    plain = Probe()
    trainer(tmp_path / "pinned", [pinned], max_steps=3).fit(plain, make_loader())
    assert pinned.measurements is None or not pinned.auto
    assert {c: pinned.table[c] for c in auto.decisions} == {c: auto.table[c] for c in auto.decisions}
    assert snapshot(measured) == snapshot(plain)  # the same training, bit for bit


def test_a_plan_survives_the_checkpoint_as_plain_types_and_its_arguments_say_the_same_table():
    plan = Plan({"matmul": Decision("matmul", "bf16", "1.8x faster"),
                 "norm": Decision("norm", "fp32", "loss moved 3%")})
    state = plan.state()
    assert yaml.safe_load(yaml.safe_dump(state)) == state  # plain types: any checkpoint format holds them
    again = Plan.from_state(state)
    assert {c: d.dtype for c, d in again.classes.items()} == {"matmul": "bf16", "norm": "fp32"}
    assert all(d.reason.endswith("(measured before the checkpoint)") for d in again.classes.values())
    words = pinned_arguments({"matmul": "bf16", "norm": "fp32", "conv": "fp32"}, None)
    assert "'matmul': 'bf16'" in words
    assert "auto" not in words


def test_a_resumed_fit_with_an_override_added_keeps_the_decision_and_applies_it_on_top(tmp_path, capsys):
    """What a NaN repair advises (an fp32 override for the culprit): the decision stays, unmeasured, the override
    acts, and the summary says so. The observer is the dispatcher: the head's GEMM runs in fp32."""
    from observer import GemmObserver, StepMark

    run, first, _ = _auto_fit(tmp_path / "first")
    path = str(tmp_path / "auto.ckpt")
    run.save_checkpoint(path)
    # a decision that lowers the GEMMs, as on a machine where bf16 is faster, so the override has something to undo
    state = torch.load(path, weights_only=False)
    (key,) = [k for k in state["callbacks"] if k.startswith("PrecisionPolicy")]
    state["callbacks"][key]["plan"]["classes"]["matmul"] = ["bf16", "measured faster"]
    torch.save(state, path)
    resumed = PrecisionPolicy(rules="auto", overrides={"head": "fp32"}, census_every_n_steps=0, trial_steps=0)
    model = Probe()
    observer = GemmObserver(model)
    run = trainer(tmp_path / "resumed", [resumed, StepMark(observer)], max_steps=5, max_epochs=3)
    with observer:
        run.fit(model, make_loader(), ckpt_path=path)
    assert resumed.measurements is None  # nothing measured again
    assert resumed.decisions["matmul"].dtype == "bf16"
    assert observer.dtypes_of("head") == {"fp32"}  # the override acts on top of the kept decision
    assert observer.dtypes_of("body") == {"bf16"}  # and the decision runs elsewhere
    out = capsys.readouterr().out
    assert "head (added after the checkpoint's decision, applied on top of it) -> fp32" in out


def _tampered(tmp_path, change):
    run, _, _ = _auto_fit(tmp_path / "first")
    path = str(tmp_path / "auto.ckpt")
    run.save_checkpoint(path)
    state = torch.load(path, weights_only=False)
    (key,) = [k for k in state["callbacks"] if k.startswith("PrecisionPolicy")]
    change(state["callbacks"][key])
    torch.save(state, path)
    return path


@pytest.mark.parametrize("change, message", [
    (lambda s: s["plan"]["classes"].update(matmul=["bf61", "x"]), r"'plan.classes.matmul': expected \[dtype, why\]"),
    (lambda s: s.update(plan="auto"), r"'plan': expected a dict with 'classes'"),
    (lambda s: s["plan"]["fp8"].update({"blocks.9.up": "measured"}), r"runs \['blocks.9.up'\] in float8, but Probe"),
])
def test_checkpoint_state_from_elsewhere_is_refused_naming_the_key_and_the_model_is_as_before(tmp_path, change,
                                                                                              message):
    path = _tampered(tmp_path, change)
    model = Probe()
    before = snapshot(model)
    policy = PrecisionPolicy(rules="auto", census_every_n_steps=0, trial_steps=0)
    with pytest.raises(ValueError, match=message):
        trainer(tmp_path / "resumed", [policy], max_steps=5, max_epochs=3).fit(model, make_loader(), ckpt_path=path)
    assert snapshot(model) == before
