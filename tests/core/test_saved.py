"""The bytes autograd saves for backward (core/saved.py), against an independent count: torch's own saved-tensor hooks
recording every packed tensor's storage."""

import torch
from torch import nn

from lightning_opkit.core.saved import SavedBytes, plain_tensors


def _independent(model: nn.Module, run) -> tuple[int, int]:
    """(activation bytes, weight bytes) saved, each storage once, counted by a hook of this test's own."""
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    activations = sum(n for ptr, n in seen.items() if ptr not in owned)
    return activations, sum(n for ptr, n in seen.items() if ptr in owned)


def test_the_count_agrees_with_an_independent_hook_on_a_small_mlp():
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32))
    x = torch.randn(16, 32, requires_grad=True)
    saved = SavedBytes(net)
    with saved.counting():
        net(x).sum()
    assert (saved.activations, saved.weights) == _independent(net, lambda: net(x).sum())


def test_a_checkpointed_block_saves_only_its_input():
    from torch.utils.checkpoint import checkpoint

    block = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 32))
    x = torch.randn(16, 32, requires_grad=True)
    plain = SavedBytes(block)
    with plain.counting():
        block(x).sum()
    checkpointed = SavedBytes(block)
    with checkpointed.counting():
        checkpoint(block, x, use_reentrant=False).sum()
    assert checkpointed.activations < plain.activations / 4


def test_attribution_sums_to_the_total_by_module_and_producer():
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    saved = SavedBytes(net)
    with saved.counting(attribute=True):
        net(torch.randn(8, 32, requires_grad=True)).sum()
    assert sum(saved.cells.values()) == saved.activations
    assert {path for path, _ in saved.cells} == {"0", "1", "2"}


def test_plain_tensors_of_a_plain_tensor_is_itself():
    t = torch.ones(3)
    assert plain_tensors(t) == [t]
