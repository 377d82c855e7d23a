"""Module-path patterns: fnmatch globs over ``named_modules()`` names."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable

from torch import nn


def _close_names(pattern: str, names: list[str], n: int = 8) -> list[str]:
    stem = pattern.replace("*", "").replace("?", "").strip(".")
    close = difflib.get_close_matches(pattern, names, n=n, cutoff=0.4)
    if stem:
        close += [name for name in names if stem in name and name not in close]
    return (close or names)[:n]


def resolve_modules(
    model: nn.Module, patterns: Iterable[str], *, argument: str = "modules"
) -> list[tuple[str, nn.Module]]:
    """Return the ``(name, module)`` pairs whose path matches any glob, in ``named_modules()`` order.

    The root module is named ``""`` and is matched only by ``""`` or ``"*"``.

    Args:
        model: the module to search.
        patterns: fnmatch globs such as ``"blocks.*.attn"``.
        argument: the constructor argument the patterns came from, for the error message.

    Raises:
        ValueError: a pattern matches no module; the message lists real names close to it.

    Example:
        >>> from torch import nn
        >>> [n for n, _ in resolve_modules(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), ["0"])]
        ['0']
    """
    named = list(model.named_modules())
    names = [name for name, _ in named if name]
    patterns = list(patterns)
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name, _ in named):
            raise ValueError(
                f"`{argument}` pattern {pattern!r} matches no module of {type(model).__name__}."
                f" Module names close to it: {_close_names(pattern, names)}"
            )
    return [(name, module) for name, module in named if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def match_rule(name: str, rules: dict[str, str]) -> str | None:
    """Return the value of the most specific glob in ``rules`` that matches ``name`` (longest pattern wins).

    Args:
        name: a module path.
        rules: glob -> value.

    Example:
        >>> match_rule("blocks.0.attn", {"blocks.*": "fp32", "blocks.*.attn": "bf16"})
        'bf16'
    """
    best: tuple[int, str] | None = None
    for pattern, value in rules.items():
        if fnmatch.fnmatchcase(name, pattern) and (best is None or len(pattern) > best[0]):
            best = (len(pattern), value)
    return None if best is None else best[1]
