"""RECOMPUTING (core/recompute.py) is set while an opkit activation checkpoint recomputes in backward, not otherwise."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_opkit.checkpointing.region import CheckpointedForward
from lightning_opkit.core.recompute import RECOMPUTING


def _block(seen):
    block = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    block[1].register_forward_hook(lambda *args: seen.append(RECOMPUTING.depth))
    return block


def test_set_only_while_a_checkpointed_block_runs_again_in_backward():
    seen = []
    block = _block(seen)
    block.forward = CheckpointedForward(block, block.forward, save=())
    block(torch.ones(2, 4, requires_grad=True)).sum().backward()
    del block.forward
    assert seen == [0, 1]  # the forward, then its recompute in backward
    assert RECOMPUTING.depth == 0


def test_torch_s_own_checkpoint_recomputes_without_it():
    seen = []
    block = _block(seen)
    checkpoint(block, torch.ones(2, 4, requires_grad=True), use_reentrant=False).sum().backward()
    assert seen == [0, 0]
