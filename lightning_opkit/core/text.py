"""Words as opkit writes them: reasons, ratios and one-line exception summaries (tables: core/logging.py)."""

from __future__ import annotations

__all__ = ["describe_error", "named_reasons", "times_phrase"]


def named_reasons(reasons: dict[str, str], most: int = 6) -> str:
    """``name (why), ...`` for the first ``most`` names in order, and how many more.

    Example:
        >>> named_reasons({"b": "too narrow", "a": "unsharded", "c": "x"}, most=2)
        'a (unsharded), b (too narrow), and 1 more'
    """
    listed = ", ".join(f"{n} ({why})" for n, why in sorted(reasons.items())[:most])
    return listed + (f", and {len(reasons) - most} more" if len(reasons) > most else "")


def times_phrase(ratio: float) -> str:
    """A measured time over a reference time in words: ``"1.80x faster"`` below 1, ``"2.17x slower"`` from 1 on.

    Example:
        >>> times_phrase(0.5), times_phrase(2.17)
        ('2.00x faster', '2.17x slower')
    """
    return f"{1 / ratio:.2f}x faster" if ratio < 1 else f"{ratio:.2f}x slower"


def describe_error(err: BaseException, limit: int | None = 160) -> str:
    r"""``"Type: first paragraph of the message"`` on one line, as reports and warnings show it.

    Torch's compiler errors append pages of hints after a blank line; the first paragraph says what happened.

    Args:
        err: the exception.
        limit: the most characters of the message kept (``None``: the whole paragraph).

    Example:
        >>> describe_error(RuntimeError("no kernel for bf16\n\nlong hints ..."))
        'RuntimeError: no kernel for bf16'
        >>> describe_error(KeyError())
        'KeyError'
    """
    first = " ".join(str(err).strip().split("\n\n")[0].split())[:limit].strip()
    return f"{type(err).__name__}: {first}" if first else type(err).__name__
