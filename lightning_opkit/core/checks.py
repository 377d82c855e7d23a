"""Constructor-argument checks shared by the callbacks: errors name the argument, the value and what is allowed."""

from __future__ import annotations

from typing import Any


def check_int(name: str, value: Any, low: int, optional: bool = False) -> None:
    """Raise unless ``value`` is an int (not a bool) of at least ``low`` (or, if ``optional``, ``None``).

    Args:
        name: the argument's name.
        value: what was passed.
        low: the smallest allowed value.
        optional: ``None`` is allowed too.

    Example:
        >>> check_int("top_k", 0, 1)
        Traceback (most recent call last):
        ...
        ValueError: Expected `top_k` to be an int >= 1, but got 0
    """
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"Expected `{name}` to be an int >= {low}{' or None' if optional else ''}, but got {value!r}")


def check_positive(name: str, value: Any, what: str) -> None:
    """Raise unless ``value`` is ``None`` or a finite number above 0.

    Args:
        name: the argument's name.
        value: what was passed.
        what: what is allowed, in words, for the message.

    Example:
        >>> check_positive("spike_zscore", -1.0, "such as 6.0, or None")
        Traceback (most recent call last):
        ...
        ValueError: Expected `spike_zscore` to be a positive number (such as 6.0, or None), but got -1.0
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")
    if value is not None and not ok:
        raise ValueError(f"Expected `{name}` to be a positive number ({what}), but got {value!r}")


def check_bools(**values: Any) -> None:
    """Raise for the first argument that is not a bool.

    Args:
        values: argument name -> what was passed.

    Example:
        >>> check_bools(fullgraph=True, fallback="yes")
        Traceback (most recent call last):
        ...
        ValueError: Expected `fallback` to be a bool, but got 'yes'
    """
    for name, value in values.items():
        if not isinstance(value, bool):
            raise ValueError(f"Expected `{name}` to be a bool, but got {value!r}")


def check_globs(name: str, value: Any, keywords: tuple[str, ...] = ()) -> None:
    """Raise unless ``value`` is ``None``, one of ``keywords``, or a non-empty list of glob strings.

    This is the kit's ``modules`` argument (where a callback acts), checked alike on every callback.

    Args:
        name: the argument's name.
        value: what was passed.
        keywords: words allowed besides globs (``("auto",)``).

    Example:
        >>> check_globs("modules", "blocks.*", ("auto",))
        Traceback (most recent call last):
        ...
        ValueError: Expected `modules` to be a list of glob strings, 'auto' or None, but got 'blocks.*'
        >>> check_globs("modules", [])
        Traceback (most recent call last):
        ...
        ValueError: `modules` is an empty list, which would match no module; use None for the default
    """
    if value is None or (isinstance(value, str) and value in keywords):
        return
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        words = "".join(f", {k!r}" for k in keywords)
        raise ValueError(f"Expected `{name}` to be a list of glob strings{words} or None, but got {value!r}")
    if not value:
        raise ValueError(f"`{name}` is an empty list, which would match no module; use None for the default")


def check_choices(name: str, value: Any, choices: tuple[Any, ...] | list[Any]) -> None:
    """Raise unless ``value`` is ``None`` or a list whose every item is one of ``choices``.

    Args:
        name: the argument's name.
        value: what was passed.
        choices: the valid items.

    Example:
        >>> check_choices("save", ["matmul", "gemm"], ("matmul", "conv"))
        Traceback (most recent call last):
        ...
        ValueError: Expected `save` to list items of ['matmul', 'conv'], but got 'gemm' in ['matmul', 'gemm']
    """
    if value is None:
        return
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"Expected `{name}` to be a list of items of {list(choices)} or None, but got {value!r}")
    for item in value:
        if not isinstance(item, str) or item not in choices:
            raise ValueError(f"Expected `{name}` to list items of {list(choices)}, but got {item!r} in {list(value)!r}")


def check_fraction(name: str, value: Any, what: str = "") -> None:
    """Raise unless ``value`` is a number (not a bool) in ``[0, 1)``.

    Args:
        name: the argument's name.
        value: what was passed.
        what: what the number means, for the message.

    Example:
        >>> check_fraction("tolerance", 1.5)
        Traceback (most recent call last):
        ...
        ValueError: Expected `tolerance` to be a number in [0, 1), but got 1.5
    """
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
        raise ValueError(f"Expected `{name}` to be a number in [0, 1){f' ({what})' if what else ''}, but got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[Any, ...] | list[Any], what: str = "") -> None:
    """Raise unless ``value`` is one of ``choices``.

    Args:
        name: the argument's name.
        value: what was passed.
        choices: the valid values.
        what: what else is allowed, for the message (``" or None"``).

    Example:
        >>> check_choice("action", "ignore", ("raise", "skip"))
        Traceback (most recent call last):
        ...
        ValueError: Expected `action` to be one of ['raise', 'skip'], but got 'ignore'
    """
    if not isinstance(value, (str, int, float, type(None))) or value not in choices:
        raise ValueError(f"Expected `{name}` to be one of {list(choices)}{what}, but got {value!r}")
