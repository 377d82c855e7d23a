"""The step governor: a table's step under the mode or under plain autocast; compiled code follows a decision."""

import lightning.pytorch as pl
import pytest
import torch
from compile.test_torch_compile import Blocks
from helpers import make_loader, trainer
from observer import GemmObserver, StepMark
from torch import nn
from zoo import build

from lightning_opkit import PrecisionPolicy, TorchCompile
from lightning_opkit.precision.dtypes import GOVERNED
from lightning_opkit.precision.governor import StepGovernor
from precision.test_auto import Injected, _row


class Changing(Injected):
    """Measures "pointwise is slower in bf16" first, "faster" at the re-measurement."""

    def _measure(self, model, batch, loss_fn, **kwargs):
        self.rows = [_row("pointwise", speed=2.0 if self._schedule.measured_at == 0 else 0.3)]
        return super()._measure(model, batch, loss_fn, **kwargs)


def test_compiled_regions_follow_a_decision_taken_after_they_were_compiled(tmp_path):
    model = Blocks(depth=2)
    seen = []
    # Outside the compiled forward (TorchCompile compiles blocks[0].forward in place): what the compiled code returned.
    # Block 0's input comes from `inp` (matmul, fp32 either way) and grad mode stays on in training, so no other guard
    # than the policy's table can make the region recompile when the decision changes at step 2.
    model.blocks[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    policy = Changing([], remeasure_every_n_steps=2, census_every_n_steps=0, whole_step=False)
    compiler = TorchCompile(modules=["blocks.*"], backend="eager")
    trainer(tmp_path, [policy, compiler], max_steps=4).fit(model, make_loader(n=48))
    assert compiler.watch.frames > 0
    assert compiler.error is None
    assert policy.table["pointwise"] == "bf16"
    assert seen == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]  # the residual add, per step


def test_the_governor_runs_a_step_under_its_table_and_a_new_table_from_the_next_op_on():
    governor = StepGovernor({"matmul": "bf16"})
    step = governor.wrap(lambda x: (x @ x).dtype, is_training=True)
    assert step(torch.ones(2, 2)) == torch.bfloat16
    governor.set_table({"matmul": "fp32"})
    assert step(torch.ones(2, 2)) == torch.float32
    with governor.running_in(None, "bf16"):  # the whole step in one dtype (a replay asks for it)
        assert step(torch.ones(2, 2)) == torch.bfloat16
    assert step(torch.ones(2, 2)) == torch.float32


def _mode_and_autocast():
    """What runs the step: the TorchFunctionModes on the stack, and CPU autocast's state and dtype."""
    return (len(torch.overrides._get_current_function_mode_stack()), torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"))


GEMMS_LOW = {"matmul": "bf16", "conv": "bf16", "attention": "bf16"}


@pytest.mark.parametrize("table, model, overrides, runs", [
    (GEMMS_LOW, nn.Linear(2, 2), False, "autocast"),
    (GEMMS_LOW | {"norm": "keep", "softmax": "keep"}, nn.Linear(2, 2), False, "autocast"),
    (GEMMS_LOW | {"norm": "fp32"}, nn.Linear(2, 2), False, "mode"),  # autocast cannot raise a norm to fp32
    ({"matmul": "bf16", "conv": "fp32"}, nn.Linear(2, 2), False, "mode"),  # nor keep a conv in fp32
    (GEMMS_LOW, nn.LSTM(2, 2), False, "mode"),  # it lowers some RNN kernels the mode leaves alone
    (GEMMS_LOW, nn.Linear(2, 2), True, "mode"),  # a module override casts every op inside its module
])
def test_a_table_autocast_expresses_runs_as_autocast_without_the_mode(table, model, overrides, runs):
    full = dict.fromkeys(GOVERNED, "keep") | table
    governor = StepGovernor(full)
    governor.express(full, model, overrides)
    seen = governor.wrap(_mode_and_autocast, is_training=True)()
    assert seen == ((0, True, torch.bfloat16) if runs == "autocast" else (1, False, torch.get_autocast_dtype("cpu")))
    governor.census_step = True  # a census step counts what ran: under the mode, inside the autocast it expresses
    assert governor.wrap(_mode_and_autocast, is_training=True)()[0] == 1
    if runs == "autocast":
        assert "autocast runs it" in governor.aside()
        with governor.running_in(None, "fp32"):  # a NaN cause replay's fp32 region needs the mode
            assert governor.wrap(_mode_and_autocast, is_training=True)()[0] == 1


@pytest.mark.parametrize("case", ["hf_gpt2", "hf_llama"])
def test_the_policy_runs_an_autocast_table_as_autocast_itself_with_the_same_numerics(tmp_path, case):
    """Observed outside opkit: the GEMMs' dtypes (a dispatch mode), the function modes active, the losses."""

    class Seen(pl.Callback):
        def __init__(self):
            self.modes, self.losses = {}, []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(outputs["loss"].detach().clone())

    def fit(precision, callbacks):
        model, seen = build(case), Seen()
        observer = GemmObserver(model.model)
        model.model.register_forward_pre_hook(
            lambda m, a: seen.modes.setdefault(model.global_step, _mode_and_autocast()) and None)
        with observer:
            trainer(tmp_path / precision, [*callbacks, seen, StepMark(observer)], max_steps=4,
                    precision=precision).fit(model, model.loader(n=16))
        return seen, observer

    policy = PrecisionPolicy(rules=dict.fromkeys(GOVERNED, "keep") | GEMMS_LOW, census_every_n_steps=2)
    governed, observer = fit("32-true", [policy])
    # a mode on census steps only (and step 0's speed check records its ops with one of its own), all in autocast
    assert {step: modes > 0 for step, (modes, _, _) in governed.modes.items()} == {0: True, 1: False, 2: True, 3: False}
    assert {(on, dtype) for _, on, dtype in governed.modes.values()} == {(True, torch.bfloat16)}
    assert {dtype for _, cls, dtype in observer.at(1) if cls == "matmul"} == {"bf16"}
    assert any("autocast runs it" in line for line in policy.summary_lines())
    plain, plain_observer = fit("bf16-mixed", [])
    assert observer.records == plain_observer.records
    assert [loss.item() for loss in governed.losses] == [loss.item() for loss in plain.losses]


def test_plain_autocast_chosen_by_auto_still_runs_the_mode_for_a_module_override():
    """auto chose plain autocast and an override was added (a resumed fit, a repair's advice): the override needs the
    mode on every step, under that autocast."""
    model = nn.Sequential(nn.Linear(2, 2))
    table = dict.fromkeys(GOVERNED, "keep")
    for overrides, runs in ((False, (0, True, torch.bfloat16)), (True, (1, True, torch.bfloat16))):
        governor = StepGovernor(table)
        governor.autocast = "bf16"  # what auto's plan says
        governor.settle(table, {}, model, overrides=overrides)
        assert governor.wrap(_mode_and_autocast, is_training=True)() == runs


def test_the_governor_runs_the_step_methods_a_user_wrote_and_leaves_the_ones_lightning_skips_unwrapped():
    from lightning_opkit.core.patch import Patches

    class OnlyTraining(pl.LightningModule):  # no validation_step nor test_step of its own
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

    model, patches = OnlyTraining(), Patches()
    table = {c: "bf16" if c == "matmul" else "fp32" for c in GOVERNED}
    governor = StepGovernor(table)
    governor.express(table, model, False)
    originals = governor.govern_steps(patches, model)
    assert sorted(originals) == ["predict_step", "training_step"]  # Lightning runs predict_step's default
    assert "validation_step" not in vars(model)
    assert "test_step" not in vars(model)
    dtypes = []
    model.layer.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    model.training_step(torch.ones(2, 4), 0)
    assert dtypes == [torch.bfloat16]  # the wrapped step ran under the policy
    patches.restore()
    assert "training_step" not in vars(model)
    model.training_step(torch.ones(2, 4), 0)
    assert dtypes == [torch.bfloat16, torch.float32]  # the user's own method again
