"""Patches (core/patch.py): what a callback sets on a model is put back, however often it is restored."""


import torch
from torch import nn

from lightning_opkit.core.patch import Patches


def test_patches_restore_idempotently():
    module = nn.Linear(2, 2)
    patches = Patches()
    patches.set(module, "forward", lambda x: x)
    patches.hold(module.register_forward_hook(lambda *a: None))
    assert torch.equal(module(torch.ones(1, 2)), torch.ones(1, 2))
    patches.restore()
    patches.restore()
    assert "forward" not in vars(module)
    assert not module._forward_hooks
