"""Which modules: globs over ``named_modules()`` names (one path component at a time), and the repeated blocks."""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterable, Sequence

from torch import nn


@functools.lru_cache(maxsize=1024)
def _compile(pattern: str) -> re.Pattern[str]:
    # ``*`` and ``?`` stay inside one component (as in a path glob); ``**`` spans any number of components, none too.
    out: list[str] = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            before = i > 0 and pattern[i - 1] == "."
            after = pattern.startswith(".", i + 2)
            if before and out:
                out.pop()  # the "." before "**" becomes optional with it
            if after:
                out.append(r"(?:\.[^.]+)*\." if before else r"(?:[^.]+\.)*")
                i += 3
            else:
                out.append(r"(?:\..*)?" if before else r".*")
                i += 2
        elif pattern[i] == "*":
            out.append(r"[^.]*")
            i += 1
        elif pattern[i] == "?":
            out.append(r"[^.]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def glob_match(name: str, pattern: str) -> bool:
    """Whether module path ``name`` matches ``pattern``.

    ``*`` matches within one dotted component, ``**`` any number of components (zero included), ``?`` one
    character of a component, ``[...]`` a character set.

    Args:
        name: a module path such as ``"blocks.0.attn"``.
        pattern: a glob such as ``"blocks.*"``.

    Example:
        >>> glob_match("blocks.0", "blocks.*"), glob_match("blocks.0.attn", "blocks.*")
        (True, False)
        >>> glob_match("blocks.0.attn", "blocks.**"), glob_match("model.blocks.0.attn", "**.attn")
        (True, True)
    """
    return _compile(pattern).match(name) is not None


def module_names(model: nn.Module, pattern: str = "**") -> list[str]:
    """The module paths of ``model`` that ``modules=`` globs match, with each module's class, to pick globs from.

    Args:
        model: the LightningModule (paths are relative to it, as the callbacks see them).
        pattern: only paths matching this glob (default: all).

    Example:
        >>> from torch import nn
        >>> module_names(nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU())))
        ['0 (Linear)', '1 (Sequential)', '1.0 (ReLU)']
    """
    return [f"{name} ({type(m).__name__})" for name, m in model.named_modules() if name and glob_match(name, pattern)]


def _close_names(pattern: str, names: list[str], n: int = 8) -> list[str]:
    stem = pattern.replace("*", "").replace("?", "").strip(".")
    close = difflib.get_close_matches(pattern, names, n=n, cutoff=0.4)
    if stem:
        close += [name for name in names if stem in name and name not in close]
    return (close or names)[:n]


def resolve_modules(
    model: nn.Module, patterns: Iterable[str], *, argument: str = "modules", owner: str = ""
) -> list[tuple[str, nn.Module]]:
    """Return the ``(name, module)`` pairs whose path matches any glob, in ``named_modules()`` order.

    The root module is named ``""`` and is matched only by ``""``, ``"*"`` or ``"**"``.

    Args:
        model: the module to search.
        patterns: globs such as ``"blocks.*.attn"`` (see :func:`glob_match`).
        argument: the constructor argument the patterns came from, for the error message.
        owner: the callback the argument belongs to, for the error message.

    Raises:
        ValueError: some patterns match no module; the message names all of them, each with real names close to it.

    Example:
        >>> from torch import nn
        >>> [n for n, _ in resolve_modules(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), ["0"])]
        ['0']
    """
    named = list(model.named_modules())
    names = [name for name, _ in named if name]
    patterns = list(patterns)
    bad = [p for p in patterns if not any(glob_match(name, p) for name, _ in named)]
    if bad:
        where = f"{owner}(`{argument}`)" if owner else f"`{argument}`"
        details = "; ".join(f"{p!r} (close: {_close_names(p, names)})" for p in bad)
        raise ValueError(
            f"{where}: {len(bad)} pattern(s) match no module of {type(model).__name__}: {details}."
            " `*` matches one path component, `**` any number; list the names with"
            " `[n for n, _ in model.named_modules()]`."
        )
    return [(name, module) for name, module in named if any(glob_match(name, p) for p in patterns)]


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
        if glob_match(name, pattern) and (best is None or len(pattern) > best[0]):
            best = (len(pattern), value)
    return None if best is None else best[1]


def outermost(named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The pairs not inside another one: ``blocks.*`` also matches ``blocks.0.attn``, and both would nest.

    Example:
        >>> layer = nn.Linear(1, 1)
        >>> [name for name, _ in outermost([("blocks.0", layer), ("blocks.0.attn", layer), ("head", layer)])]
        ['blocks.0', 'head']
    """
    names = [n for n, _ in named]
    return [(n, m) for n, m in named if not inside(n, names)]


def inside(path: str, regions: Sequence[str]) -> bool:
    """Whether module ``path`` lies strictly inside one of ``regions`` (``""``, the root, holds every other module).

    Example:
        >>> inside("blocks.0.fc", ["blocks.0"]), inside("blocks.0", ["blocks.0"]), inside("head", [""])
        (True, False, True)
    """
    return any(path != r and (r == "" or path.startswith(r + ".")) for r in regions)


def find_blocks(model: nn.Module) -> list[str]:
    """Paths of the repeated blocks of ``model``, the outermost such sets.

    Blocks are the children of a ``ModuleList`` / ``Sequential`` whose children all share one class that has
    submodules of its own (a block, not a leaf layer).

    Args:
        model: the model to search (the LightningModule, so paths match ``named_modules()`` there).

    Example:
        >>> from torch import nn
        >>> block = lambda: nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([block(), block()]))
        >>> find_blocks(net)
        ['1.0', '1.1']
    """
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        if any(name == f or name.startswith(f + ".") for f in found):
            continue  # inside a block already chosen: the outermost set wins
        kinds = {type(child) for child in module}
        if len(kinds) == 1 and next(module[0].children(), None) is not None:
            found.extend(f"{name}.{i}" if name else str(i) for i in range(len(module)))
    return found
