"""The kit's warnings: on rank zero only, and each once per run.

Under DDP every rank builds the same report, so a warning per rank says one thing N times; a fault that repeats (a
NaN every step under ``action="warn"``, a replay that fails at each fault) says it once, and the rest is counted in
TensorBoard and the run summary. A run starts at each fit's setup (:func:`new_run`, called by every opkit callback).
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable

from lightning.pytorch.utilities.rank_zero import rank_zero_only

__all__ = ["OpkitWarning", "new_run", "warn_once"]


class OpkitWarning(UserWarning):
    """A warning from an opkit callback: shown on rank zero, once per run per kind."""


_said: set[Hashable] = set()


def new_run() -> None:
    """Forget what was said: the next fit says each warning once again."""
    _said.clear()


def warn_once(text: str, key: Hashable = None, stacklevel: int = 2) -> bool:
    """Warn ``text`` on rank zero unless this run already warned under ``key`` (``None``: the text itself).

    Args:
        text: the warning.
        key: what counts as the same warning (a fault's kind and module, say); ``None`` = the same text.
        stacklevel: as for :func:`warnings.warn`, counted from the caller.

    Returns:
        Whether it was said now.

    Example:
        >>> import warnings
        >>> new_run()
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     said = [warn_once(f"module 'fc' went NaN at step {s}", key=("nan", "fc")) for s in (1, 2)]
        >>> said, [str(w.message) for w in caught]
        ([True, False], ["module 'fc' went NaN at step 1"])
    """
    key = text if key is None else key
    if key in _said or rank_zero_only.rank != 0:  # type: ignore[attr-defined]
        return False
    _said.add(key)
    warnings.warn(text, OpkitWarning, stacklevel=stacklevel + 1)
    return True
