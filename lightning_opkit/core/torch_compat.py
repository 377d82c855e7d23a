"""The torch APIs that differ between the supported releases, each behind one name here.

opkit supports torch 2.9 through 2.15. Where a release renamed, added or changed an API opkit calls, the difference is
handled here and nowhere else; ``tests/test_torch_api.py`` checks every name on the running release.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["outside_dispatch_modes"]


@contextlib.contextmanager
def outside_dispatch_modes() -> Iterator[None]:
    """Inside, no Python dispatch mode sees the ops run: opkit's own bookkeeping (a census's fp32 reference).

    A selective activation checkpoint caches the outputs of the ops it saves in a dispatch mode, in call order, and
    hands them back in that order when its forward runs again in backward: an extra op of opkit's in the forward
    would shift every later one.

    Example:
        >>> import torch
        >>> with outside_dispatch_modes():
        ...     torch.ones(2).sum().item()
        2.0
    """
    with _disable_current_modes():
        yield
