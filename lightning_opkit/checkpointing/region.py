"""One checkpointed block, Trainer-free: the forward that replaces the module's, and the op-class policy it saves by.

The block's forward runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: its activations are not
kept for backward but computed again there. With ``save`` classes, the checkpoint is selective: outputs of ops of
those classes (torchtitan saves GEMMs and attention) are kept, and only the rest is recomputed.

The recompute runs in backward, outside ``training_step``, where a precision policy's function mode is no longer
active: the torch function modes active at the forward are entered again around the recompute, so it computes in the
same dtypes (checkpoint itself restores autocast and the RNG), inside
:data:`~lightning_opkit.core.recompute.RECOMPUTING` so a census counts its ops once.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_opkit.core.recompute import RECOMPUTING
from lightning_opkit.core.suspend import SUSPENDED
from lightning_opkit.core.torch_compat import TorchDispatchMode, function_mode_stack
from lightning_opkit.opclass import classify_name

__all__ = ["CheckpointedForward", "save_policy"]


@functools.cache
def _class_of(op: Any) -> str:
    return classify_name(op.name()) if hasattr(op, "name") else "other"


def save_policy(save: tuple[str, ...]) -> Callable[..., CheckpointPolicy]:
    """The selective checkpoint policy: keep the outputs of ops in ``save`` classes, recompute the rest.

    Args:
        save: operator classes whose outputs are kept.

    Example:
        >>> policy = save_policy(("matmul", "attention"))
        >>> policy(None, torch.ops.aten.mm.default).name, policy(None, torch.ops.aten.gelu.default).name
        ('MUST_SAVE', 'PREFER_RECOMPUTE')
    """
    kept = frozenset(save)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if _class_of(op) in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _recompute_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


class _Kept(TorchDispatchMode):
    """Hands the outputs a selective checkpoint keeps to ``note``: they are held in its cache, not saved by autograd."""

    def __init__(self, kept: frozenset[str], note: Callable[[Any], None]) -> None:
        super().__init__()
        self.kept, self.note = kept, note

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _class_of(func) in self.kept:
            self.note(out)
        return out


@contextlib.contextmanager
def _again(modes: list[Any], inner: Any, buffers: list[torch.Tensor]) -> Iterator[None]:
    """Around a recompute: the forward's function modes again, the selective context, the recompute flag.

    The block's buffers are put back after it: a BatchNorm's forward run again in training mode would update its
    running statistics a second time.
    """
    kept = [b.clone() for b in buffers]
    autocast = _autocast_state()
    try:
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            stack.enter_context(RECOMPUTING.scope())
            stack.enter_context(inner)
            yield
    finally:  # also when checkpoint stops the recompute early, by an exception, once it has what backward needs
        with torch.no_grad():
            for buffer, value in zip(buffers, kept, strict=True):
                buffer.copy_(value)
        _restore_autocast(autocast)


_DEVICES = ("cpu", "cuda")


def _autocast_state() -> tuple[int, bool, list[tuple[bool, torch.dtype]]]:
    """Autocast's nesting level, cache switch, and each device's switch and dtype."""
    level = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return level, torch.is_autocast_cache_enabled(), [(torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                                                      for d in _DEVICES]


def _restore_autocast(state: tuple[int, bool, list[tuple[bool, torch.dtype]]]) -> None:
    """Put autocast back as :func:`_autocast_state` found it.

    A compiled region's graph enters and leaves autocast as two calls (a precision policy's casts run with autocast
    off); a recompute stopped early between them left autocast entered: one nesting level a step, so autocast never
    dropped its cache of cast weights again and later steps computed with stale ones.
    """
    level, cache, devices = state
    while torch.autocast_increment_nesting() - 1 > level:
        torch.autocast_decrement_nesting()
        torch.autocast_decrement_nesting()
    if torch.autocast_decrement_nesting() == 0:
        torch.clear_autocast_cache()  # as leaving the outermost autocast does
    torch.set_autocast_cache_enabled(cache)
    for device, (enabled, dtype) in zip(_DEVICES, devices, strict=True):
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, dtype)


@torch.compiler.disable
def _outside_the_graph(region: CheckpointedForward, args: tuple, kwargs: dict) -> Any:
    """The checkpointed forward run eagerly in a compiled model: dynamo breaks the graph around this call."""
    return region(*args, **kwargs)


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


class CheckpointedForward:
    """What replaces a checkpointed module's ``forward``: the original, its activations recomputed in backward.

    Args:
        module: the checkpointed module (its buffers are put back after a recompute).
        original: its current ``forward``.
        save: operator classes whose outputs are kept (selective); empty: keep only the block's inputs.

    Example:
        >>> layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
        >>> layer.forward = CheckpointedForward(layer, layer.forward, save=())
        >>> layer(torch.ones(2, 4, requires_grad=True)).sum().backward()
        >>> del layer.forward  # back to the class's
    """

    def __init__(self, module: torch.nn.Module, original: Callable[..., Any], save: tuple[str, ...]) -> None:
        self.original = original
        self.buffers = [b for b in module.buffers() if not b.is_sparse]
        self.save = save
        self.policy = save_policy(save) if save else None
        #: off: the forward runs as written (a measurement step without checkpointing, an eval step)
        self.enabled = True
        #: off: under compile, the checkpoint runs outside the graph (a graph break), as it runs eagerly
        self.traced = True
        #: while measuring: told of every output a selective checkpoint keeps (what it holds besides the inputs)
        self.note_kept: Callable[[Any], None] | None = None

        def context_fn() -> tuple[Any, Any]:
            if SUSPENDED.depth or torch.compiler.is_compiling():
                # Compiled code runs the region (TorchCompile's backend) and recomputes it from its own graph, where
                # a precision policy's casts are nodes already: only the save policy goes along. Always one: torch
                # before 2.13 ran a compiled checkpoint without a context function as a plain run that saved all.
                return create_selective_checkpoint_contexts(self.policy or _recompute_all)
            # A graph break ran this traced call eagerly after all (the memory view's saved-tensor hooks make one):
            # the recompute then runs the module's Python again and needs the forward's modes, as below.
            return self._contexts()

        self._context_fn = context_fn

    def _contexts(self) -> tuple[Any, Any]:
        modes = function_mode_stack()
        if self.policy is not None:
            forward, recompute = create_selective_checkpoint_contexts(self.policy)
            if self.note_kept is not None:
                forward = _both(forward, _Kept(frozenset(self.save), self.note_kept))
        else:
            forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
        return forward, _again(modes, recompute, self.buffers)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.enabled and torch.is_grad_enabled()) or RECOMPUTING:
            return self.original(*args, **kwargs)
        if torch.compiler.is_compiling():
            if not self.traced:
                return _outside_the_graph(self, args, kwargs)
            # Compiled (TorchCompile attached after this callback): dynamo traces the checkpoint as one region, and
            # its context function (a plain function, the form dynamo keeps) runs where the traced region runs.
            return checkpoint(self.original, *args, use_reentrant=False, context_fn=self._context_fn, **kwargs)
        return checkpoint(self.original, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)
