"""What autograd keeps for backward, counted: the bytes of the activations a step saves, by unique storage."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lightning_opkit.core.ranks import local, local_floats

__all__ = ["SavedBytes"]


class SavedBytes:
    """Counts the bytes of the tensors autograd saves for backward, each storage once, parameters and buffers apart.

    A view saved twice (a transpose of a saved input) is one storage; a tensor saved inside a checkpointed region is
    not saved at all (the checkpoint keeps its inputs instead), so the count is what the step holds until backward.

    Args:
        model: the model whose parameters and buffers are not activations.

    Example:
        >>> net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        >>> saved = SavedBytes(net)
        >>> with saved.counting():
        ...     loss = net(torch.ones(8, 64, requires_grad=True)).sum()
        >>> saved.activations // 1024, saved.weights // 1024  # KiB: input, linear out, gelu out; both weights
        (6, 32)
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self.activations = 0
        self.weights = 0
        self._owned: set[Any] = set()
        self._seen: set[Any] = set()

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Inside, every tensor autograd saves is counted (pack hook), then handed on unchanged."""
        self._owned = {_key(local(t)) for t in (*self._model.parameters(), *self._model.buffers())}
        self._seen = set()

        def pack(tensor: Tensor) -> Tensor:
            self.note(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield

    def note(self, value: Any) -> None:
        """Count the tensors in ``value`` as held for backward, each storage once.

        That is what autograd saves, and what a selective checkpoint keeps in its own cache.
        """
        for tensor in local_floats(value) if not isinstance(value, Tensor) else [value]:
            t = local(tensor)
            key = _key(t)
            if key in self._seen:
                continue
            self._seen.add(key)
            size = t.untyped_storage().nbytes()
            if key in self._owned:
                self.weights += size
            else:
                self.activations += size


def _key(t: Tensor) -> Any:
    return t.device, t.untyped_storage().data_ptr()
