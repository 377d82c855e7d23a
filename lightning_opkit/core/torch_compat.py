"""The torch APIs that differ between the supported releases, each behind one name here.

opkit supports torch 2.9 through 2.15. Where a release renamed, added or changed an API opkit calls, the difference is
handled here and nowhere else; ``tests/core/test_torch_compat.py`` checks every name on the running release.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

#: whether AOT autograd (every ``torch.compile`` backend but ``"eager"``) traces a ``TorchFunctionMode``'s casts into
#: a correct backward: on 2.9.1 the backward mixed dtypes (``mm`` of bf16 and fp32, ``native_batch_norm_backward``)
#: or differed from eager by 1.6e-4; 2.11 and later pass (2.10 was not run)
FUNCTION_MODES_UNDER_AOT = torch.__version__ >= "2.11"

#: whether dynamo compiles a region that runs inside a selective activation checkpoint (its dispatch mode active): on
#: 2.9.1 it compiled nothing there, and the region ran eagerly (0 graphs); 2.11 and later compile it (2.10 not run)
COMPILES_UNDER_SELECTIVE_CHECKPOINT = torch.__version__ >= "2.11"

__all__ = ["COMPILES_UNDER_SELECTIVE_CHECKPOINT", "FUNCTION_MODES_UNDER_AOT", "cpu_memory_events",
           "events_with_dtypes", "outside_dispatch_modes"]


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


def cpu_memory_events(prof: Any) -> list[tuple[int, int]] | None:
    """Every CPU allocation (positive bytes) and free (negative) a profiler run recorded, as ``(time in ns, bytes)``.

    The raw records, each at its own time: a ``FunctionEvent``'s memory figures are summed over the op and charged at
    its start, and an op that encloses the step (``Optimizer.step`` around Lightning's closure) is charged the frees of
    the whole forward and backward before they ran. ``None`` where the profiler keeps no such records.

    Args:
        prof: a stopped ``torch.profiler.profile`` run with ``profile_memory=True``.
    """
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        return None
    out = []
    for event in results.events():
        if event.name() == "[memory]" and str(event.device_type()).endswith("CPU"):
            start = event.start_ns() if hasattr(event, "start_ns") else 1000 * event.start_us()
            out.append((int(start), int(event.nbytes())))
    return out


def events_with_dtypes(prof: Any) -> Any:
    """``prof.events()``, each with ``input_dtypes`` on every supported torch.

    The dtypes are named as the profiler names them (``"float"``, ``"c10::BFloat16"``). torch 2.13 records them on
    each ``FunctionEvent``. Before, they are only on the profiler's kineto events (``dtypes()``), which share their
    correlation id with the ``FunctionEvent`` made from them (its ``id``): they are copied over once. Without them
    the roofline took every op for fp32 (no bf16 GEMM speed, an embedding's gather counted as the whole table's
    bytes).

    Args:
        prof: a stopped ``torch.profiler.profile`` run with ``record_shapes=True``.
    """
    events = prof.events()
    if not events or hasattr(events[0], "input_dtypes"):
        return events
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    dtypes = {} if results is None else {e.correlation_id(): list(e.dtypes()) for e in results.events()
                                          if e.name() != "[memory]"}
    for event in events:
        event.input_dtypes = dtypes.get(event.id, [])
    return events
