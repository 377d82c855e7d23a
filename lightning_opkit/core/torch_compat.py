"""The torch APIs that differ between the supported releases, and torch's private names, each behind one name here.

opkit supports torch 2.9 through 2.15. Where a release renamed, added or changed an API opkit calls, the difference is
handled here and nowhere else; ``tests/core/test_torch_compat.py`` checks every name on the running release. The
private names opkit needs (pytree, the multi-tensor ops, the mode stacks, the module base classes the taxonomy sorts
by, a GradScaler's state, the CUDA allocator's history, the profiler's event list) are read only here too:
``tests/test_layout.py`` fails on one used anywhere else in the package (dynamo's and Inductor's are in
:mod:`.dynamo_compat`, FSDP2's in :mod:`.fsdp`, torchao's in :mod:`.torchao_compat`, Lightning's in
:mod:`.lightning_compat`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch._ops import HigherOrderOperator
from torch.autograd.profiler_util import EventList
from torch.nn.modules.batchnorm import _NormBase as NormBase
from torch.nn.modules.conv import _ConvNd as ConvNd
from torch.nn.modules.dropout import _DropoutNd as DropoutNd
from torch.nn.modules.loss import _Loss as Loss
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

#: whether AOT autograd (every ``torch.compile`` backend but ``"eager"``) traces a ``TorchFunctionMode``'s casts into
#: a correct backward: on 2.9.1 the backward mixed dtypes (``mm`` of bf16 and fp32, ``native_batch_norm_backward``)
#: or differed from eager by 1.6e-4; 2.11 and later pass (2.10 was not run)
FUNCTION_MODES_UNDER_AOT = torch.__version__ >= "2.11"

#: whether dynamo compiles a region that runs inside a selective activation checkpoint (its dispatch mode active): on
#: 2.9.1 it compiled nothing there, and the region ran eagerly (0 graphs); 2.11 and later compile it (2.10 not run)
COMPILES_UNDER_SELECTIVE_CHECKPOINT = torch.__version__ >= "2.11"

__all__ = ["COMPILES_UNDER_SELECTIVE_CHECKPOINT", "FUNCTION_MODES_UNDER_AOT", "ConvNd", "DropoutNd",
           "HigherOrderOperator", "Loss", "NormBase", "TorchDispatchMode", "cpu_memory_events", "dump_memory_snapshot",
           "event_list", "events_with_dtypes", "foreach_copy_", "foreach_non_finite_check_", "foreach_norm",
           "function_mode_stack", "mark_scheduler_wrapped", "outside_dispatch_modes", "profiler_enabled",
           "record_memory_history", "scaler_tensors", "takes_found_inf", "tree_leaves", "tree_map"]


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


#: each tensor's norm in one multi-tensor call (one fused kernel on CUDA): ``foreach_norm(tensors, ord, dtype=...)``.
#: torch's own function, not a wrapper: the per-step check calls it on every checked step
foreach_norm = torch._foreach_norm
#: copy each source into its destination in place, in one multi-tensor call: ``foreach_copy_(destinations, sources)``
foreach_copy_ = torch._foreach_copy_
#: GradScaler's unscale, in place: ``found_inf`` (a 1-element float tensor) is set to 1 where any element of any tensor
#: is non-finite, and each tensor is multiplied by ``inv_scale`` (a 0-d float tensor; by 1.0 it is rewritten bit for
#: bit, a pass that writes). On CPU one call over many small tensors costs less host time than a norm per tensor
foreach_non_finite_check_ = torch._amp_foreach_non_finite_check_and_unscale_


def function_mode_stack() -> list[Any]:
    """The ``TorchFunctionMode``s in force now, outermost first.

    Example:
        >>> function_mode_stack()
        []
    """
    return list(_get_current_function_mode_stack())


def profiler_enabled() -> bool:
    """Whether a torch profiler records right now (one flag read: checked on every compiled region's call).

    Example:
        >>> profiler_enabled()
        False
    """
    return bool(torch.autograd.profiler._is_profiler_enabled)


def scaler_tensors(scaler: Any) -> list[Tensor]:
    """A ``torch.amp.GradScaler``'s own state tensors: its scale and growth tracker.

    Both are made at its first ``scale``; the rest of its state is rebuilt at every ``update``.

    Example:
        >>> scaler_tensors(torch.amp.GradScaler("cpu"))
        []
    """
    tensors = (getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None))
    return [t for t in tensors if isinstance(t, Tensor)]


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` leaves its update out on the device when given ``found_inf`` (fused optimizers).

    Example:
        >>> params = [torch.nn.Parameter(torch.ones(2))]
        >>> takes_found_inf(torch.optim.AdamW(params, fused=True)), takes_found_inf(torch.optim.AdamW(params))
        (True, False)
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def mark_scheduler_wrapped(step: Any, wrapper: Any) -> None:
    """Mark ``wrapper`` (which replaces an optimizer's ``step``) as the LR schedulers marked ``step``.

    Torch's LR schedulers warn that ``optimizer.step`` was overridden unless the step they wrapped carries their mark.
    """
    if hasattr(step, "_wrapped_by_lr_sched"):
        wrapper._wrapped_by_lr_sched = True


def record_memory_history(max_entries: int | None) -> None:
    """Record (``max_entries`` events at most) or, with ``None``, stop recording the CUDA allocator's history."""
    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """Write the CUDA allocator's recorded history to ``path`` (a pickle for pytorch.org/memory_viz)."""
    torch.cuda.memory._dump_snapshot(path)


def event_list(events: Any, kept: list[Any]) -> Any:
    """A profiler ``EventList`` of ``kept`` (some of ``events``), with ``events``' settings and its parent links.

    Its events keep the parents and children torch linked in the whole list, so the tree is not built again.
    """
    out = EventList(kept, use_device=getattr(events, "_use_device", None),
                    profile_memory=getattr(events, "_profile_memory", False),
                    with_flops=getattr(events, "_with_flops", False))
    out._tree_built = True
    return out
