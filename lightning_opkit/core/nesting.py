"""A nesting counter: how many times a scope is entered right now, read cheaply on hot paths."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["Nesting"]


class Nesting:
    """Counts how deep inside a scope the program is; true while inside at least once.

    Read as ``nesting.depth`` (one attribute load) where every op pays for the read.

    Example:
        >>> replaying = Nesting()
        >>> with replaying.scope():
        ...     with replaying.scope():
        ...         inside = replaying.depth
        >>> inside, bool(replaying)
        (2, False)
    """

    __slots__ = ("depth",)

    def __init__(self) -> None:
        self.depth = 0

    def __bool__(self) -> bool:
        return self.depth > 0

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Inside, the counter is one deeper (nests; exceptions unwind it)."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
