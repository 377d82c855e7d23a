"""The kit's off switch: ``OPKIT_DISABLE`` (every callback, or some areas) and each callback's ``enabled``.

A callback that is off attaches nothing: every Lightning hook of it does nothing, it is no member of the kit (no other
callback reads it, no summary lines, no charts), and it says so once, at the fit's setup, on rank zero.
"""

from __future__ import annotations

import os

__all__ = ["AREAS", "ENV", "disabled_areas"]

#: the environment variable; ``1`` or ``all`` turns every callback off, else a comma-separated list of areas
ENV = "OPKIT_DISABLE"

#: each callback's area, as in its tags ``opkit/<area>/...``
AREAS = ("precision", "nan", "profiler", "compile", "checkpointing")

_ALL = frozenset({"1", "all", "true", "yes"})
_NONE = frozenset({"0", "false", "no"})


def disabled_areas(value: str | None = None) -> frozenset[str]:
    """The areas ``OPKIT_DISABLE`` turns off (read from the environment when ``value`` is ``None``).

    Args:
        value: the variable's text: ``1`` / ``all`` (every area), ``0`` or empty (none), or areas such as
            ``nan,compile``.

    Raises:
        ValueError: an area that is none of :data:`AREAS`, naming it and the valid ones.

    Example:
        >>> sorted(disabled_areas("nan, compile"))
        ['compile', 'nan']
        >>> disabled_areas("1") == frozenset(AREAS), disabled_areas("")
        (True, frozenset())
    """
    text = os.environ.get(ENV, "") if value is None else value
    names = {name.strip().lower() for name in text.split(",") if name.strip()}
    if names and names <= _ALL:
        return frozenset(AREAS)
    if names <= _NONE:
        return frozenset()
    unknown = sorted(names - set(AREAS))
    if unknown:
        raise ValueError(f"{ENV}={text!r}: {', '.join(map(repr, unknown))} is no opkit area; expected 1 or all"
                         f" (every callback), 0, or a comma-separated list of {', '.join(AREAS)}")
    return frozenset(names)
