"""Reversible instance-attribute patches and hook handles, removed idempotently."""

from __future__ import annotations

from typing import Any

from torch.utils.hooks import RemovableHandle

_MISSING = object()


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
    """

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        self._handles: list[RemovableHandle] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name = value``, remembering what was in ``obj.__dict__`` before.

        Args:
            obj: the object (usually a module instance).
            name: the attribute.
            value: the new value.
        """
        self._saved.append((obj, name, vars(obj).get(name, _MISSING)))
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
            obj, name, old = self._saved.pop()
            if old is _MISSING:
                vars(obj).pop(name, None)
            else:
                vars(obj)[name] = old

    def __bool__(self) -> bool:
        return bool(self._saved or self._handles)
