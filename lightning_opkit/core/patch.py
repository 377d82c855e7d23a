"""Reversible instance-attribute patches and hook handles, removed idempotently; scopes counted as they nest."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.utils.hooks import RemovableHandle

_MISSING = object()

#: every live patch of every :class:`Patches`: ``[obj, name, old, new]``, so one undone out of order hands its
#: ``old`` to the patch laid over it (two callbacks wrapping one module's ``forward`` tear down in any order)
_LIVE: list[list[Any]] = []


class Patches:
    """Set attributes on objects and hold hook handles; :meth:`restore` undoes everything, any number of times.

    Patching an instance attribute (``pl_module.training_step = wrapper``) shadows the class method without
    touching the class; restoring deletes the instance attribute again, or puts back one the user had set.

    Example:
        >>> class A:
        ...     def f(self):
        ...         return 1
        >>> a, patches = A(), Patches()
        >>> patches.set(a, "f", lambda: 2)
        >>> a.f(), patches.restore(), a.f(), "f" in vars(a)
        (2, None, 1, False)

    Two owners patching one attribute may restore in either order:

        >>> first, second = Patches(), Patches()
        >>> first.set(a, "f", lambda: 2); second.set(a, "f", lambda: 3)
        >>> first.restore(); a.f()  # the second's patch stays until it is undone, then the class's comes back
        3
        >>> second.restore(); a.f(), "f" in vars(a)
        (1, False)
    """

    def __init__(self) -> None:
        self._saved: list[list[Any]] = []
        self._handles: list[RemovableHandle] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name = value``, remembering what was in ``obj.__dict__`` before.

        Args:
            obj: the object (usually a module instance).
            name: the attribute.
            value: the new value.
        """
        record = [obj, name, vars(obj).get(name, _MISSING), value]
        self._saved.append(record)
        _LIVE.append(record)
        setattr(obj, name, value)

    def hold(self, handle: RemovableHandle) -> RemovableHandle:
        """Keep a hook handle so :meth:`restore` removes it.

        Args:
            handle: what ``register_*_hook`` returned.
        """
        self._handles.append(handle)
        return handle

    def restore(self) -> None:
        """Undo every patch (last first) and remove every held hook."""
        while self._handles:
            self._handles.pop().remove()
        while self._saved:
            record = self._saved.pop()
            _undo(record)

    def __bool__(self) -> bool:
        return bool(self._saved or self._handles)


def _undo(record: list[Any]) -> None:
    """Put back what ``record`` replaced; if another patch was laid over it since, that one will put it back."""
    obj, name, old, new = record
    del _LIVE[next(i for i, r in enumerate(_LIVE) if r is record)]
    if vars(obj).get(name, _MISSING) is not new:
        above = next((r for r in _LIVE if r[0] is obj and r[1] == name and r[2] is new), None)
        if above is not None:
            above[2] = old  # the patch above now restores to what this one found
            return
    if old is _MISSING:
        vars(obj).pop(name, None)
    else:
        vars(obj)[name] = old


# A nesting counter lives here too: a scope entered and left as exactly as a patch is set and undone.


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
