"""Text as opkit writes it: markdown tables for TensorBoard's text plugin, and one-line exception summaries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["describe_error", "markdown_table", "named_reasons", "times_phrase"]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Render a markdown table, as TensorBoard's text plugin shows it.

    Args:
        headers: column names.
        rows: one sequence of cells per row; floats in fixed point with three decimals (never ``1.372e+04``).

    Example:
        >>> print(markdown_table(["a", "b"], [[1, 13720.5]]))
        | a | b |
        |---|---|
        | 1 | 13720.500 |
    """

    def cell(value: Any) -> str:
        text = _fixed(value) if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


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


def _fixed(value: float) -> str:
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    if value == 0 or abs(value) >= 1e-3:
        return f"{value:.3f}"
    return f"{value:.1e}"  # below a thousandth, three decimals would read as zero


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
