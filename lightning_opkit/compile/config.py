"""TorchCompile's arguments: checks that name the bad value and the valid ones, and the backend callable built."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

import torch

from lightning_opkit.core.checks import check_bools, check_choice, check_globs
from lightning_opkit.core.dynamo_compat import backend_callable, inductor_defaults, inductor_modes
from lightning_opkit.core.suspend import suspending_backend

__all__ = ["ON_RECOMPILE_LIMIT", "backends", "check_compile_args", "make_backend"]

ON_RECOMPILE_LIMIT = ("warn", "eager", "raise")

def backends() -> list[str]:
    """The ``torch.compile`` backends this torch knows, by name."""
    return sorted(set(torch.compiler.list_backends(exclude_tags=())) | {"inductor", "eager", "aot_eager"})


def check_compile_args(modules: Any, backend: Any, mode: Any, options: Any, dynamic: Any, on_recompile_limit: Any,
                       **bools: Any) -> None:
    """Raise for the first bad ``TorchCompile`` argument, naming it, its value and what is valid.

    Args:
        modules: ``None``, ``"auto"`` or globs.
        backend: a backend name.
        mode: an Inductor mode or ``None``.
        options: Inductor options or ``None``.
        dynamic: ``True``, ``False`` or ``None``.
        on_recompile_limit: one of :data:`ON_RECOMPILE_LIMIT`.
        bools: the boolean arguments by name.

    Example:
        >>> check_compile_args(None, "eager", None, None, "yes", "warn")
        Traceback (most recent call last):
        ...
        ValueError: Expected `dynamic` to be True, False or None, but got 'yes'
    """
    known = backends()
    if not isinstance(backend, str) or backend not in known:
        raise ValueError(f"Expected `backend` to be one of {known}, but got {backend!r}")
    if mode is not None:
        check_choice("mode", mode, inductor_modes(), " or None")
    if options is not None:
        if mode is not None:
            raise ValueError("`mode` and `options` cannot both be set (torch.compile takes one or the other)")
        _check_options(backend, options)
    check_globs("modules", modules, ("auto",))
    check_bools(**bools)
    check_choice("on_recompile_limit", on_recompile_limit, ON_RECOMPILE_LIMIT)
    if dynamic is not None and not isinstance(dynamic, bool):
        raise ValueError(f"Expected `dynamic` to be True, False or None, but got {dynamic!r}")


def _check_options(backend: str, options: Any) -> None:
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ValueError(f"Expected `options` to be a dict of Inductor option names to values, but got {options!r}")
    if backend in ("eager", "aot_eager"):
        raise ValueError(f"`options` are read by the inductor backend only; backend={backend!r} would ignore"
                         f" {sorted(options)}. Drop `options` or use backend='inductor'.")
    if backend != "inductor":
        return  # a third-party backend reads its own options
    defaults = inductor_defaults()
    bad = [k for k in options if k not in defaults]
    if bad:
        hints = {k: difflib.get_close_matches(k, list(defaults), n=3) for k in bad}
        raise ValueError(f"Unknown Inductor option(s) {bad} in `options`; close valid names: {hints}")
    for key, value in options.items():
        default = defaults[key]
        if default is not None and value is not None and not _same_kind(value, type(default)):
            raise ValueError(f"`options[{key!r}]` is {value!r}; Inductor expects a {type(default).__name__}"
                             f" (default {default!r})")


def _same_kind(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def make_backend(name: str, mode: str | None, options: dict[str, Any] | None,
                 dynamic: bool | None) -> Callable[..., Any]:
    """The backend as a callable, wrapped so opkit's precision mode stands aside while it compiles and runs.

    The callable is what ``torch.compile`` builds from a name, mode and options; the mode's casts are already in the
    graph, so meeting the mode again while the graph runs would decide twice.

    Args:
        name: the backend's name.
        mode: an Inductor mode.
        options: Inductor options.
        dynamic: dynamic shapes.
    """
    return suspending_backend(backend_callable(name, mode, options, dynamic))
