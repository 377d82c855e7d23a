"""FSDP2's float8 all-gather without a Trainer (precision/fp8_gather.py): on one in-process gloo rank, and on 4
processes where FSDP2 can reshard after forward to a smaller group.

The Trainer runs (2 processes, every callback, compile, auto, the zoo's Llama) are in tests/test_sharded.py.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_opkit.core.ranks import local
from lightning_opkit.core.saved import plain_tensors
from lightning_opkit.precision.fp8 import gemm_function
from lightning_opkit.precision.fp8_gather import Float8AllGather, float8_weight, gather_lines
from tests.precision.fp8_gather_script import Dequantizing

SCRIPT = os.path.join(os.path.dirname(__file__), "fp8_gather_script.py")


@pytest.fixture
def sharded(tmp_path):
    """Two dequantizing Linears, each and the root ``fully_shard``-ed over one gloo rank."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model = nn.Sequential(Dequantizing(16, 32), nn.GELU(), Dequantizing(32, 16))
        for module in (model[0], model[2], model):
            fully_shard(module, mesh=mesh)
        yield model
    finally:
        dist.destroy_process_group()


def _install(gather, model, names):
    _, config, mm_config = gemm_function("tensorwise")
    gather.install(model, dict.fromkeys(names), mm_config, config)


def _handed(model, i):
    """The kind of weight module ``i`` is handed in a forward: float8 (gathered so) or not."""
    seen = []
    hook = model[i].register_forward_pre_hook(lambda module, args: seen.append(float8_weight(module.weight)))
    try:
        model(torch.randn(4, 16)).sum().backward()
    finally:
        hook.remove()
    return seen


def test_install_gathers_in_float8_and_the_state_dict_and_release_hand_back_plain_shards(sharded):
    plain_local = sharded[0].weight.to_local()
    gather = Float8AllGather()
    _install(gather, sharded, ["0", "2"])
    assert (gather.gathered, gather.live, gather.skipped) == (["0", "2"], ["0", "2"], {})
    assert _handed(sharded, 0) == [True]
    # what the kit reads as this rank's shard (checks, memory, the saved-tensor count) is the plain tensor inside
    assert type(local(sharded[0].weight)) is torch.Tensor
    (inner,) = plain_tensors(sharded[0].weight.to_local())  # the wrapper holds the plain shard alone
    assert inner.untyped_storage().data_ptr() == local(sharded[0].weight).untyped_storage().data_ptr()
    state = sharded.state_dict()
    assert {type(v.to_local()) for v in state.values()} == {torch.Tensor}
    assert torch.equal(state["0.weight"].to_local(), plain_local)  # the same values: the wrapper is over them
    assert gather.release("0")
    assert not gather.release("0")  # released already
    assert (gather.gathered, gather.live) == (["2"], ["2"])
    assert type(sharded[0].weight.to_local()) is torch.Tensor
    assert _handed(sharded, 0) == [False]
    assert _handed(sharded, 2) == [True]
    gather.restore()
    assert (gather.gathered, gather.live) == (["2"], [])  # restore keeps the record of what ran
    assert sum(len(m._state_dict_hooks) for m in sharded.modules()) == 0
    assert _handed(sharded, 2) == [False]


def test_installed_again_after_a_restore_it_is_recorded_once(sharded):
    gather = Float8AllGather()
    _install(gather, sharded, ["0"])
    gather.restore()
    _install(gather, sharded, ["0"])
    assert (gather.gathered, gather.live) == (["0"], ["0"])
    assert _handed(sharded, 0) == [True]
    assert gather_lines(gather) == ["  fp8: 1 weight(s) gathered by FSDP2 in float8 (torchao's all-gather)"]
    gather.reset()
    assert (gather.gathered, gather.live, gather_lines(gather)) == ([], [], [])


def test_precomputed_scales_are_those_each_gather_would_compute(sharded):
    gather = Float8AllGather()
    _install(gather, sharded, ["0", "2"])
    scales = {0: [], 2: []}  # the scale of the float8 weight each Linear is handed
    hooks = [sharded[i].register_forward_pre_hook(lambda module, args, i=i: scales[i].append(module.weight._scale))
             for i in (0, 2)]
    x = torch.randn(4, 16)
    try:
        dynamic = sharded(x)  # each gather all-reduces its own amax
        gather.precompute_scales()
        assert all(sharded[i].weight._local_tensor._precomputed_scale is not None for i in (0, 2))
        precomputed = sharded(x)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(dynamic, precomputed)
    assert all(len(s) == 2 and torch.equal(s[0], s[1]) for s in scales.values())
    optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
    gather.watch([optimizer])
    sharded(x).sum().backward()
    optimizer.step()  # the weights change: the scales precomputed before are dropped
    assert all(sharded[i].weight._local_tensor._precomputed_scale is None for i in (0, 2))
    gather.release("0")  # a weight installed afresh gathers with its own amax again
    _install(gather, sharded, ["0"])
    assert sharded[0].weight._local_tensor._precomputed_scale is None
    gather.restore()
    assert not optimizer._optimizer_step_post_hooks  # restore leaves the optimizer as it was


def test_a_module_not_sharded_by_fsdp2_is_left_and_named(sharded):
    model = nn.ModuleDict({"sharded": sharded, "plain": Dequantizing(16, 16)})
    gather = Float8AllGather()
    _install(gather, model, ["sharded.0", "plain"])
    assert gather.gathered == ["sharded.0"]
    assert gather.skipped == {"plain": "not an FSDP2-sharded parameter"}
    assert gather_lines(gather)[-1].endswith("gathered in their own dtype: plain (not an FSDP2-sharded parameter)")
    gather.restore()


def test_a_weight_resharded_after_forward_to_a_smaller_group_is_left_in_its_dtype(tmp_path):
    # FSDP2 raises NotImplementedError gathering a float8 shard from a smaller post-forward group (the backward's
    # all-gather after reshard_after_forward=2 of 4 ranks): that Linear is left in fp32 and named, the other one is
    # gathered in float8, and two steps run on all 4 ranks
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in results:
        assert r["gathered"] == ["2"]
        assert r["skipped"] == {"0": "resharded after forward to a smaller group (reshard_after_forward=<int>)"}
        assert r["handed"] == {"0": [False], "2": [True]}
        assert r["grads_finite"]
        assert (r["live"], r["after"]) == ([], ["Tensor"])
    # one seed and batch on every rank: the weights each gathered (float8 or fp32) are the same whole weights
    assert len({json.dumps(r["losses"]) for r in results}) == 1
