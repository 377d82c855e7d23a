"""rules="auto" under TorchCompile: code compiled before a decision follows it (the class table is guarded)."""

import torch
from compile.test_torch_compile import Blocks
from helpers import make_loader, trainer

from lightning_opkit import TorchCompile
from lightning_opkit.precision.governor import StepGovernor
from precision.test_auto import Injected, _row


class Changing(Injected):
    """Measures "pointwise is slower in bf16" first, "faster" at the re-measurement."""

    def _measure(self, model, batch, loss_fn, **kwargs):
        self.rows = [_row("pointwise", speed=2.0 if self._measured_at == 0 else 0.3)]
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
