"""What autograd keeps for backward, counted: the bytes of the activations a step saves, by unique storage.

Optionally attributed: to the innermost module whose forward was running when the tensor was saved, and to the
operator class of the op that produced it (its ``grad_fn``, through views, reshapes and copies; ``"input"`` for a
tensor no op of the step produced).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from lightning_opkit.core.ranks import local, local_floats
from lightning_opkit.opclass import classify_name

__all__ = ["SavedBytes", "plain_tensors"]


class SavedBytes:
    """Counts the bytes of the tensors autograd saves for backward, each storage once, parameters and buffers apart.

    A view saved twice (a transpose of a saved input) is one storage; a tensor saved inside a checkpointed region is
    not saved at all (the checkpoint keeps its inputs instead), so the count is what the step holds until backward.

    Args:
        model: the model whose parameters and buffers are not activations.

    Example:
        >>> net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        >>> saved = SavedBytes(net)
        >>> with saved.counting(attribute=True):
        ...     loss = net(torch.ones(8, 64, requires_grad=True)).sum()
        >>> saved.activations // 1024, saved.weights // 1024  # KiB: input, linear out, gelu out; both weights
        (6, 32)
        >>> {path: n // 1024 for (path, cls), n in saved.cells.items()}  # KiB saved while each module ran
        {'0': 2, '1': 2, '2': 2}
        >>> sorted({cls for (path, cls) in saved.cells})  # what produced them: the input, a GEMM, an activation
        ['activation', 'input', 'matmul']
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self.activations = 0
        self.weights = 0
        #: ``(innermost module path, op class of the producer) -> bytes``, with ``counting(attribute=True)``: each
        #: storage once, where it was first saved
        self.cells: dict[tuple[str, str], int] = {}
        #: module path -> bytes saved while it ran (its submodules included), each storage once per module: a
        #: block's input saved by its first layer counts for the block even if the layer before saved it too
        self.by_module: dict[str, int] = {}
        self._module_seen: dict[str, set[Any]] = {}
        self._owned: set[Any] = set()
        self._seen: set[Any] = set()
        self._stack: list[str] = []
        self._attributing = False

    @contextlib.contextmanager
    def counting(self, attribute: bool = False) -> Iterator[None]:
        """Inside, every tensor autograd saves is counted (pack hook), then handed on unchanged.

        Args:
            attribute: also attribute each to the running module and the producing op's class (:attr:`cells`);
                global module hooks, removed on the way out.
        """
        self._owned = {_key(local(t)) for t in (*self._model.parameters(), *self._model.buffers())}
        self._seen, self.cells, self._stack, self.by_module, self._module_seen = set(), {}, [], {}, {}
        self._attributing = attribute

        def pack(tensor: Tensor) -> Tensor:
            self.note(tensor)
            return tensor

        with contextlib.ExitStack() as stack:
            if attribute:
                self._attribute(stack)
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor))
            yield

    def _attribute(self, stack: contextlib.ExitStack) -> None:
        paths = {id(m): p for p, m in self._model.named_modules()}
        frames = self._stack

        def enter(module: nn.Module, args: Any) -> None:
            frames.append(paths.get(id(module), frames[-1] if frames else ""))

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if frames:
                frames.pop()

        stack.callback(register_module_forward_pre_hook(enter).remove)
        stack.callback(register_module_forward_hook(leave, always_call=True).remove)

    def note(self, value: Any) -> None:
        """Count the tensors in ``value`` as held for backward, each storage once.

        That is what autograd saves, and what a selective checkpoint keeps in its own cache.
        """
        for tensor in local_floats(value) if not isinstance(value, Tensor) else [value]:
            for t in plain_tensors(local(tensor)):
                self._note(tensor, t)

    def _note(self, tensor: Tensor, t: Tensor) -> None:
        """Count ``t``, a plain tensor of ``tensor`` (itself, or one inside a wrapper such as a float8 weight)."""
        key = _key(t)
        size = t.untyped_storage().nbytes()
        if key in self._owned:
            if key not in self._seen:
                self._seen.add(key)
                self.weights += size
            return
        path = self._stack[-1] if self._stack else ""
        if self._attributing:
            for prefix in _prefixes(path):
                seen = self._module_seen.setdefault(prefix, set())
                if key not in seen:
                    seen.add(key)
                    self.by_module[prefix] = self.by_module.get(prefix, 0) + size
        if key in self._seen:
            return
        self._seen.add(key)
        self.activations += size
        cell = (path, _producer(tensor))
        self.cells[cell] = self.cells.get(cell, 0) + size


def plain_tensors(t: Tensor) -> list[Tensor]:
    """``t``, or the plain tensors a wrapper subclass holds (a float8 weight: its 1-byte data and its scale).

    A wrapper subclass has no storage of its own to read; what it holds in memory is its inner tensors'.

    Example:
        >>> [x.shape for x in plain_tensors(torch.ones(2, 3))]
        [torch.Size([2, 3])]
    """
    if getattr(type(t), "__tensor_flatten__", None) is None:
        return [t]
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    return [plain for name in names for plain in plain_tensors(getattr(t, name))]


def _prefixes(path: str) -> list[str]:
    """``"a.b.c"`` -> ``["", "a", "a.b", "a.b.c"]``."""
    parts = path.split(".") if path else []
    return [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]


def _producer(tensor: Tensor) -> str:
    """The op class of the op that computed ``tensor``: through views, reshapes and copies to the op under them."""
    node = tensor.grad_fn
    for _ in range(16):  # nn.MultiheadAttention's projections reach their saved form through 8 views and a clone
        if node is None:
            return "input"
        cls = classify_name(node.name())
        if cls not in ("layout", "copy") or not node.next_functions:
            return cls
        node = node.next_functions[0][0]
    return "layout"


def _key(t: Tensor) -> Any:
    return t.device, t.untyped_storage().data_ptr()
