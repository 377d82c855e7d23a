"""Old argument spellings that keep working for one release, each with a warning that names the new one.

The kit's vocabulary (``docs/arguments.md``): ``modules`` selects where a callback acts, ``measure`` means "measure
before deciding", ``..._every_n_steps=0`` means off. Arguments that said these things otherwise are renamed; the old
name is still a constructor argument (so a LightningCLI config that uses it still parses) and is mapped here.
"""

from __future__ import annotations

import warnings
from typing import Any, TypeVar

__all__ = ["OpkitDeprecationWarning", "renamed"]

T = TypeVar("T")


class OpkitDeprecationWarning(FutureWarning):
    """An opkit argument spelled the old way: it works for this release; the warning names the new spelling.

    A ``FutureWarning`` rather than a ``DeprecationWarning``: Python shows those to users by default, and it is the
    user's config that must change.
    """


def renamed(owner: str, old: str, old_value: Any, new: str, new_value: T, new_default: T) -> T:
    """The value of ``new``, taken from ``old`` (with a warning) when the caller spelled it the old way.

    Args:
        owner: the callback's class name, for the messages.
        old: the old argument's name; ``old_value`` is ``None`` when the caller did not pass it.
        old_value: what was passed under the old name.
        new: the new argument's name.
        new_value: what was passed under the new name.
        new_default: the new argument's default (a caller who passes both, differently, is refused).

    Raises:
        ValueError: both spellings passed, with different values.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     renamed("TorchCompile", "measure_speedup", True, "measure", False, False)
        True
        >>> print(caught[0].message)
        TorchCompile(measure_speedup=...) is deprecated and will be removed in the next release: use measure=... \
(the same meaning)
    """
    if old_value is None:
        return new_value
    if new_value != new_default and new_value != old_value:
        raise ValueError(f"{owner}({old}={old_value!r}, {new}={new_value!r}): `{old}` is the old name of `{new}`;"
                         f" pass only `{new}`")
    warnings.warn(f"{owner}({old}=...) is deprecated and will be removed in the next release: use {new}=..."
                  " (the same meaning)", OpkitDeprecationWarning, stacklevel=3)
    return old_value
