"""The decision in force, Trainer-free (precision/in_force.py): what a step runs after a plan is applied, a module
override and a pin held while their patches hold, the checkpoint and the arguments read from the same value."""

import torch
from torch import nn

from lightning_opkit.core.patch import Patches
from lightning_opkit.precision.config import initial_table
from lightning_opkit.precision.decide import Decision
from lightning_opkit.precision.fp8 import Float8Linears
from lightning_opkit.precision.governor import StepGovernor
from lightning_opkit.precision.in_force import DecisionInForce
from lightning_opkit.precision.plan import Plan


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


def _in_force(rules=None):
    table = initial_table(rules, "keep")
    governor = StepGovernor(table)
    return DecisionInForce(table, governor, Float8Linears("tensorwise", census=governor.census)), governor


def _dtypes_run(governor, model):
    """Each Linear's output dtype when a step runs under the governor: seen from forward hooks, not the table."""
    seen = {}
    handles = [m.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.dtype))
               for name, m in model.named_children()]
    governor.wrap(lambda x: model(x), is_training=True)(torch.ones(2, 4))
    for handle in handles:
        handle.remove()
    return seen


def test_a_plan_applied_is_what_the_next_step_runs_and_what_every_report_reads():
    now, governor = _in_force()
    model = _Two()
    assert _dtypes_run(governor, model) == {"a": torch.bfloat16, "b": torch.bfloat16}  # the built-in table
    plan = Plan({"matmul": Decision("matmul", "fp32", "not 5% faster")})
    now.apply(plan, model, {})
    assert _dtypes_run(governor, model) == {"a": torch.float32, "b": torch.float32}
    assert now.table["matmul"] == "fp32"
    assert now.table["norm"] == "fp32"  # a class the model was not seen to run: fp32 under a plan
    assert now.decisions == {"matmul": plan.classes["matmul"]}
    assert now.as_arguments("tensorwise").startswith("PrecisionPolicy(rules={'matmul': 'fp32'")
    assert Plan.from_state(now.state({})["plan"]).dtypes == {"matmul": "fp32"}  # the checkpoint's round trip


def test_nothing_is_reported_or_saved_before_a_plan():
    now, _ = _in_force({"matmul": "bf16"})
    assert now.decisions == {}
    assert now.as_arguments("tensorwise") is None
    assert now.state({}) == {}


def test_an_override_and_a_pin_hold_while_their_patches_hold_and_release_takes_the_pin_off():
    now, governor = _in_force({"matmul": "bf16"})
    model, patches = _Two(), Patches()
    now.install(patches, model, [("a", model.a)], {"a": "fp32"}, torch.device("cpu"), auto=False)
    assert _dtypes_run(governor, model) == {"a": torch.float32, "b": torch.bfloat16}
    now.pin(patches, "b", model.b, "fp32")
    assert _dtypes_run(governor, model) == {"a": torch.float32, "b": torch.float32}
    assert now.labelled_overrides({"a": "fp32"}) == {"a": "fp32", "b (pinned by a NaN repair)": "fp32"}
    patches.restore()
    now.release()
    assert now.pinned == {}
    assert _dtypes_run(governor, model) == {"a": torch.bfloat16, "b": torch.bfloat16}
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
