"""FSDP2's modules and parameter records as opkit reads them (core/fsdp.py), on a real one-rank gloo group."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_opkit.core.fsdp import (
    fsdp_modules,
    fully_sharded,
    gathers_extensions,
    local_shard,
    reshard,
    swap_local_shard,
    weight_records,
)


@pytest.fixture
def sharded(tmp_path):
    """A Linear-ReLU-Linear whose first Linear and root are ``fully_shard``-ed over one gloo rank."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        yield model
    finally:
        dist.destroy_process_group()


def test_a_plain_model_has_no_fsdp_module_nor_record():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    assert fsdp_modules(model) == []
    assert not fully_sharded(model)
    assert weight_records(model) == {}


def test_the_sharded_modules_and_each_weight_s_record_and_owner_are_found(sharded):
    assert fsdp_modules(sharded) == [sharded, sharded[0]]
    assert fully_sharded(sharded)
    records = weight_records(sharded)
    assert set(records) == {id(sharded[0]), id(sharded[2])}  # weights only: no bias, no ReLU
    record, owner = records[id(sharded[0])]
    assert owner is sharded[0]
    assert record.sharded_param is sharded[0].weight
    assert records[id(sharded[2])][1] is sharded  # the root's own Linear is gathered with the root


def test_reshard_puts_back_what_a_forward_alone_left_gathered(sharded):
    sharded(torch.randn(2, 8))  # no backward: the root keeps its Linear gathered
    assert not isinstance(sharded[2].weight, DTensor)
    reshard(sharded)
    assert isinstance(sharded[2].weight, DTensor)
    assert isinstance(sharded[0].weight, DTensor)


def test_the_private_fsdp2_and_torchao_fields_opkit_reads_and_writes_are_where_it_looks(sharded):
    """core/fsdp.py reaches past FSDP2's wall: on a real FSDP2 model every private name it reads or writes is there
    (a torch release that moves one fails here first)."""
    group = sharded._get_fsdp_state()._fsdp_param_group
    fsdp_param = group.fsdp_params[0]
    for name in ("_sharded_param_data", "_init_extensions", "all_gather_outputs", "_unsharded_inner_tensors",
                 "sharded_param", "free_unsharded_param"):
        assert hasattr(fsdp_param, name), name
    assert isinstance(fsdp_param.sharded_param, DTensor)
    assert isinstance(fsdp_param.sharded_param._local_tensor, torch.Tensor)


def test_swapping_a_local_shard_keeps_the_parameter_and_puts_the_old_one_back(sharded):
    record, _ = weight_records(sharded)[id(sharded[0])]
    param = sharded[0].weight
    before = local_shard(record)
    copy = before.clone()
    old = swap_local_shard(record, copy)
    assert sharded[0].weight is param  # the optimizer's parameter object stays
    assert local_shard(record) is copy
    assert old[0] is before
    assert gathers_extensions(record)
    out = sharded(torch.randn(2, 8))  # FSDP2 gathers the new shard afresh
    out.sum().backward()
    swap_local_shard(record, *old)
    assert local_shard(record) is before
