"""One checkpointed block (checkpointing/region.py), Trainer-free: gradients as without it, the ops recomputed in
backward counted by a dispatch mode of this test's own (all of them, or all but the kept classes'), a BatchNorm not
updated twice, and the forward's function modes entered again around the recompute."""

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_opkit.checkpointing.region import CheckpointedForward, save_policy
from lightning_opkit.precision.function_mode import ModeState, PolicyMode


class _Ops(TorchDispatchMode):
    """The aten ops run inside, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _grads_and_backward_ops(block, x):
    out = block(x).square().sum()
    with _Ops() as ops:
        out.backward()
    return [p.grad.clone() for p in block.parameters()], ops.names


def test_full_and_selective_checkpoints_give_the_same_gradients_and_recompute_what_they_do_not_keep():
    x = torch.randn(4, 8)
    plain = _block()
    expected, plain_ops = _grads_and_backward_ops(plain, x)
    # full: the first Linear and the GELU again (the checkpoint stops once it has what backward needs: the last
    # Linear's output is saved by nothing); selective on matmul: the GELU alone
    for save, recomputed_gemms in (((), 1), (("matmul",), 0)):
        block = _block()
        block.forward = CheckpointedForward(block, block.forward, save=save)
        grads, ops = _grads_and_backward_ops(block, x)
        del block.forward
        assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
        extra = ops.copy()
        for name in plain_ops:  # what backward runs anyway
            if name in extra:
                extra.remove(name)
        assert sum(name.startswith("addmm") for name in extra) == recomputed_gemms, (save, extra)
        assert sum(name.startswith("gelu.") for name in extra) == 1  # the activation is recomputed either way


def test_a_batchnorm_in_the_block_is_updated_once_per_step():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    twin = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    twin.load_state_dict(block.state_dict())
    block.forward = CheckpointedForward(block, block.forward, save=())
    x = torch.randn(16, 8)
    block(x).sum().backward()
    twin(x).sum().backward()
    assert torch.equal(block[1].running_mean, twin[1].running_mean)
    assert int(block[1].num_batches_tracked) == 1


def test_the_recompute_runs_in_the_forward_s_dtypes_under_a_policy_mode():
    block = _block()
    block.forward = CheckpointedForward(block, block.forward, save=())
    seen = []
    block[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    state = ModeState({"matmul": "bf16", "activation": "fp32"})
    with PolicyMode(state):
        out = block(torch.randn(4, 8))
    out.float().sum().backward()  # backward outside the mode, as Lightning runs it
    assert seen == [torch.bfloat16, torch.bfloat16]  # the forward, and its recompute in backward


def test_the_save_policy_keeps_the_classes_asked():
    policy = save_policy(("matmul",))
    assert policy(None, torch.ops.aten.mm.default).name == "MUST_SAVE"
    assert policy(None, torch.ops.aten.gelu.default).name == "PREFER_RECOMPUTE"
