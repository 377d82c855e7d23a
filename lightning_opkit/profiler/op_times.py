"""Turn a finished torch.profiler window into per-op-class times, a top-k table and memory/FLOP figures.

Plain functions over ``prof.key_averages()`` and ``prof.events()``, tested without a Trainer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torch.autograd import DeviceType

from lightning_opkit.core.torch_compat import cpu_memory_events, event_list, events_with_dtypes
from lightning_opkit.opclass import NO_ARITHMETIC, OP_CLASSES, classify_profiler_event, is_framework_event
from lightning_opkit.profiler.session import SETTLE

#: dynamo's and Inductor's compile spans (torch's ``dynamo_timed`` names, forward and backward): a recompile inside a
#: window traces the region's ops on fake tensors under them, no part of any step's work (measured: 599 of 701 aten
#: events of a window that recompiled a small MLP once)
_COMPILING = re.compile(r"^(entire_frame_compile|_compile\.compile_inner|compile_fx_inner|"
                        r"compile_fx\.<locals>\.bw_compiler|backward\._backward_impl)( \(dynamo_timed\))?$")


def _compiling(event: Any, seen: dict[int, bool]) -> bool:
    """Whether ``event`` ran under a compile span (each ancestor looked at once over the window: ``seen``)."""
    chain, parent, found = [], event.cpu_parent, False
    while parent is not None:
        known = seen.get(id(parent))
        if known is not None:
            found = known
            break
        if _COMPILING.match(parent.name):
            found = True
            break
        chain.append(parent)
        parent = parent.cpu_parent
    for ancestor in chain:
        seen[id(ancestor)] = found
    return found


def compiling_seconds(prof: Any) -> float:
    """Host seconds a window spent in dynamo's and Inductor's compile spans (the outermost ones, each once).

    Args:
        prof: a stopped ``torch.profiler.profile``.
    """
    seen: dict[int, bool] = {}
    return sum(float(e.cpu_time_total) for e in prof.events()
               if _COMPILING.match(e.name) and not _compiling(e, seen)) / 1e6


def window_events(prof: Any) -> Any:
    """A window's events: ``prof.events()`` with their input dtypes, less what was no part of its steps' work.

    Left out: what began once the window was settling (the gloo barrier of
    :func:`~lightning_opkit.profiler.session.settle_collectives` runs under the profiler, waiting for the records of
    the last step's collectives), and what dynamo and Inductor ran while compiling (a recompile inside the window
    traces the region's ops on fake tensors, without shapes: counted, they were work no step did).

    Args:
        prof: a stopped ``torch.profiler.profile``.
    """
    events = events_with_dtypes(prof)
    cut = min((e.time_range.start for e in events if e.name == SETTLE), default=None)
    seen: dict[int, bool] = {}
    kept_events = [e for e in events if (cut is None or e.time_range.start < cut)
                   and not _COMPILING.match(e.name) and not _compiling(e, seen)]
    if len(kept_events) == len(events):
        return events
    return event_list(events, kept_events)


@dataclass
class OpRow:
    """One operator's totals in a window (times in microseconds)."""

    name: str
    op_class: str
    calls: int
    self_us: float
    total_us: float
    flops: int


@dataclass
class WindowReport:
    """What a window measured; times in microseconds, summed over its active steps."""

    steps: int
    step_time_ms: float
    ops: list[OpRow] = field(default_factory=list)
    class_self_us: dict[str, float] = field(default_factory=dict)
    #: self time of framework spans (profiler step, optimizer step's Python, data loading): the loop's overhead
    framework_self_us: float = 0.0
    #: total time per compiled region (TorchCompile's ``opkit region <path>`` spans)
    region_total_us: dict[str, float] = field(default_factory=dict)
    peak_memory_bytes: float | None = None
    flops: int = 0
    #: wall time of communication events (collectives, point-to-point; any thread or stream), their intervals merged
    communication_us: float = 0.0
    #: the part of it during which no compute op ran: communication the step waited for, not hidden behind compute
    exposed_communication_us: float = 0.0
    #: on a GPU, the device time of every kernel, copy and memset the window recorded, each once (``None`` on CPU):
    #: what the op-class shares divide among the classes
    device_us: float | None = None
    #: per step, the time dynamo and Inductor spent compiling inside the window: left out of ``step_time_ms``
    compiling_ms: float = 0.0

    @property
    def total_self_us(self) -> float:
        """All operator self time in the window (framework spans apart): the denominator of every share."""
        return sum(self.class_self_us.values())

    def class_percent(self) -> dict[str, float]:
        """Share of profiled self time per op class, in percent (sums to 100)."""
        total = self.total_self_us or 1.0
        return {cls: 100.0 * us / total for cls, us in self.class_self_us.items()}


_REGION = "opkit region "


def on_device(event: Any) -> bool:
    """Whether a profiler row or event is on the device's timeline (a kernel, a copy, a GPU annotation), not a CPU op.

    On a GPU every kernel shows twice: as a device row of its own, and in the self device time of the CPU op that
    launched it. opkit counts it once, through its launcher, which says its op class; GPU annotations (a
    ``record_function`` span's device side) hold whole spans of other kernels and are never work.

    Example:
        >>> from torch.autograd import DeviceType
        >>> from torch.autograd.profiler_util import FunctionEvent
        >>> on_device(FunctionEvent(0, "aten::mm", 0, 0, 1)), on_device(FunctionEvent(1, "gemm", 0, 0, 1,
        ...                                                                           device_type=DeviceType.CUDA))
        (False, True)
    """
    return getattr(event, "device_type", DeviceType.CPU) != DeviceType.CPU


def summarize(prof: Any, step_times_s: list[float], *, use_device: bool) -> WindowReport:
    """Summarize a stopped profiler.

    On a GPU (``use_device``) time is device time, each kernel counted once, in the op class of the CPU op that
    launched it (:func:`on_device`); kernels launched straight from a framework span (CUDA graph replays) count as
    ``other``. Framework spans' own time is host time (the loop's Python overhead), apart from the shares.

    Args:
        prof: a ``torch.profiler.profile`` whose trace has been collected.
        step_times_s: wall time of each active step, in seconds.
        use_device: rank by device (CUDA) self time instead of CPU self time.
    """
    ops = []
    framework_us = 0.0
    regions: dict[str, float] = {}
    device_us = 0.0
    for e in window_events(prof).key_averages():
        if use_device and on_device(e):
            if not getattr(e, "is_user_annotation", False):
                device_us += float(e.self_device_time_total)
            continue
        self_us = float(e.self_device_time_total if use_device else e.self_cpu_time_total)
        total_us = float(e.device_time_total if use_device else e.cpu_time_total)
        if is_framework_event(e.key):
            framework_us += float(e.self_cpu_time_total)
            if e.key.startswith(_REGION):
                regions[e.key[len(_REGION):]] = total_us
            if use_device and self_us:
                ops.append(OpRow(e.key, "other", int(e.count), self_us, total_us, 0))
            continue
        ops.append(OpRow(e.key, classify_profiler_event(e.key), int(e.count), self_us, total_us, int(e.flops or 0)))
    ops.sort(key=lambda r: r.self_us, reverse=True)
    class_self = dict.fromkeys(OP_CLASSES, 0.0)
    for row in ops:
        class_self[row.op_class] += row.self_us
    steps = len(step_times_s)
    communication, exposed = communication_time(prof, use_device=use_device)
    # a recompile inside the window is no step's work: its time leaves the step time as its ops left the classes
    compiling = min(compiling_seconds(prof), sum(step_times_s))
    return WindowReport(
        steps=steps,
        step_time_ms=1e3 * (sum(step_times_s) - compiling) / steps if steps else 0.0,
        compiling_ms=1e3 * compiling / steps if steps else 0.0,
        ops=ops,
        class_self_us=class_self,
        framework_self_us=framework_us,
        region_total_us=regions,
        flops=sum(r.flops for r in ops),
        communication_us=communication,
        exposed_communication_us=exposed,
        device_us=device_us if use_device else None,
    )


def communication_time(prof: Any, use_device: bool = False) -> tuple[float, float]:
    """``(communication, exposed communication)`` wall time of a window, in microseconds.

    Communication is the union of the intervals of communication events; exposed is the part of that union no compute
    overlaps. On CPU both are host events: collectives (``gloo:all_gather``, c10d's ops, FSDP2's collective spans) on
    every thread, against compute ops (a class other than communication, layout and other). On a GPU both are device
    events on the device's timeline: NCCL kernels against every other kernel, copy and memset on any stream (a CPU
    span only says when work was launched, not when it ran).

    Args:
        prof: a stopped profiler.
        use_device: read the device's timeline (a GPU window).
    """
    comm: list[tuple[float, float]] = []
    compute: list[tuple[float, float]] = []
    for e in window_events(prof):
        if use_device != on_device(e) or (use_device and getattr(e, "is_user_annotation", False)):
            continue
        key = getattr(e, "key", None) or e.name
        if is_framework_event(key):
            continue
        cls = classify_profiler_event(key)
        span = (float(e.time_range.start), float(e.time_range.end))
        if cls == "communication":
            comm.append(span)
        elif use_device or cls not in NO_ARITHMETIC:
            compute.append(span)
    comm, compute = _union(comm), _union(compute)
    total = sum(b - a for a, b in comm)
    return total, total - _overlap(comm, compute)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def peak_cpu_memory(prof: Any) -> float:
    """Peak of the running sum of CPU allocations minus frees over the window, in bytes.

    Args:
        prof: a stopped profiler run with ``profile_memory=True``.
    """
    deltas = cpu_memory_events(prof)
    if deltas is None:
        # Without the raw records: allocations charged to the op that made them (self usage, so nested ops are not
        # counted twice), frees outside any op as "[memory]" events; an enclosing op's frees come too early here.
        deltas = [(e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
                  for e in prof.events()]
    deltas.sort()
    running = peak = 0
    for _, delta in deltas:
        running += delta
        peak = max(peak, running)
    return float(peak)
