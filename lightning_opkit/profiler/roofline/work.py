"""Where each op class stands against this device: work per class, achieved rates and the bound.

Trainer-free, over a stopped ``torch.profiler`` run with ``record_shapes=True`` and ``with_flops=True`` (the
profiler's own GEMM and convolution counts), against the measured peaks of :mod:`~.peaks`. ProfilerWindows'
``roofline`` option logs it per window; the views (table, lever, picture) are in :mod:`~.view`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch.utils import flop_counter

from lightning_opkit.opclass import (
    GEMM_CLASSES,
    NO_ARITHMETIC,
    classify_profiler_event,
    fused_kernel_ops,
    is_framework_event,
)
from lightning_opkit.profiler.op_times import on_device, window_events
from lightning_opkit.profiler.roofline.peaks import Peaks

__all__ = ["ClassRoofline", "UnrecordedShapes", "achieved_rates", "class_rooflines"]

_ITEMSIZE = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "BFloat16": 2, "Half": 2, "long int": 8,
             "int": 4, "bool": 1, "unsigned char": 1, "signed char": 1, "short int": 2,
             "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}
_DTYPE_NAMES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "double": "fp64",
                "c10::Float8_e4m3fn": "fp8", "c10::Float8_e5m2": "fp8"}
#: functional collectives' bookkeeping: a wait, a wrap for autograd (DTensor's and torchao's collectives go through
#: them, each with the collective's tensor): no byte moves there, the collective itself counts them
_NOT_TRANSFERS = ("_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd")
#: arithmetic per element of the elementwise-like classes (a LayerNorm reads, centres, squares, sums, scales)
_FLOPS_PER_ELEMENT = {"norm": 8.0, "softmax": 5.0, "activation": 8.0, "loss": 4.0, "reduction": 1.0,
                      "pointwise": 1.0, "embedding": 0.0, "copy": 0.0}
#: below this much time per op, an op far under both roofs is bound by launch or host cost
_OVERHEAD_CALL_S = 100e-6


@dataclass
class ClassRoofline:
    """One op class in one window: its work, its time, and its rates against the peaks.

    ``seconds`` is the self time of the class's ops (wrappers' and shape-less ops' included: the op-class share's
    time); ``unknown_seconds`` that of the ops whose work the trace does not record: Inductor's fused kernels of this
    class, which it records without shapes, and (``unrecorded_calls`` of them) GEMMs with an operand's shape missing,
    as compiled code's ``aten::addmm`` was seen to be on CPU. Their time counts with the class, their work is not
    known, so they stay out of the rates. ``calls`` counts the ops whose work is known.
    """

    op_class: str
    flops_by_dtype: dict[str, float] = field(default_factory=dict)
    bytes: float = 0.0
    seconds: float = 0.0
    calls: int = 0
    unknown_seconds: float = 0.0
    unknown_calls: int = 0
    unrecorded_calls: int = 0

    @property
    def flops(self) -> float:
        """FLOPs of the ops whose work is known."""
        return sum(self.flops_by_dtype.values())

    @property
    def dtype(self) -> str:
        """The dtype that did most of its FLOPs (``"+"``-joined when a second did a tenth or more)."""
        ranked = sorted(self.flops_by_dtype.items(), key=lambda kv: -kv[1])
        if not ranked:
            return "-"
        names = [d for d, f in ranked if f >= 0.1 * ranked[0][1]]
        return "+".join(names)

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else 0.0

    @property
    def tflops(self) -> float:
        """Achieved TFLOP/s."""
        return self.flops / self.seconds / 1e12 if self.seconds else 0.0

    @property
    def gbps(self) -> float:
        """Achieved GB/s."""
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    def compute_seconds(self, peaks: Peaks) -> float:
        """Time its FLOPs take at the measured GEMM peak of the dtype each ran in."""
        return sum(f / peaks.peak(d) for d, f in self.flops_by_dtype.items() if peaks.peak(d) > 0)

    def memory_seconds(self, peaks: Peaks) -> float:
        """Time its bytes take at the measured copy bandwidth."""
        return self.bytes / (peaks.bandwidth_gbps * 1e9) if peaks.bandwidth_gbps else 0.0

    def pct_peak(self, peaks: Peaks) -> float:
        """Achieved FLOP/s as % of the measured GEMM peak of its dtype(s)."""
        return 100 * self.compute_seconds(peaks) / self.seconds if self.seconds else 0.0

    def pct_bandwidth(self, peaks: Peaks) -> float:
        """Achieved bytes/s as % of the measured copy bandwidth."""
        return 100 * self.memory_seconds(peaks) / self.seconds if self.seconds else 0.0

    def roof_seconds(self, peaks: Peaks) -> float:
        """The least time the roofline allows it: its FLOPs at the peak or its bytes at the bandwidth."""
        return max(self.compute_seconds(peaks), self.memory_seconds(peaks))

    def bound(self, peaks: Peaks) -> tuple[str, float]:
        """``(what bounds it, % of that roof)``: compute, memory, overhead or dispatch.

        Compute or memory by its arithmetic intensity against the ridge (peak over bandwidth). Overhead: under 10% of
        its roof (ten times the time both its FLOPs at the peak and its bytes at the bandwidth would take) in ops of
        under 100 us each: launch or host cost. Big ops that far below their roof keep their bound; the lever calls
        them slow kernels. Dispatch: none of its ops recorded work of its own (the math path of attention, whose
        GEMMs and softmax count in their own classes).
        """
        compute, memory = self.compute_seconds(peaks), self.memory_seconds(peaks)
        pct = 100 * max(compute, memory) / self.seconds if self.seconds else 0.0
        if not self.calls:
            return "dispatch", pct
        if pct < 10 and self.seconds / self.calls < _OVERHEAD_CALL_S:
            return "overhead", pct  # far below both roofs in many small ops: launch or host cost
        return ("compute" if compute >= memory else "memory"), pct

    def lost_seconds(self, peaks: Peaks) -> float:
        """Time above its roof: what the lever could win at most."""
        return max(0.0, self.seconds - self.roof_seconds(peaks))


def _bytes(shapes: list[Any], dtypes: list[str]) -> float:
    total = 0.0
    for shape, dtype in zip(shapes, dtypes or ["float"] * len(shapes)):
        if isinstance(shape, list) and shape and all(isinstance(d, int) for d in shape):
            total += math.prod(shape) * _ITEMSIZE.get(dtype, 4)
        elif isinstance(shape, list) and shape and all(isinstance(d, list) for d in shape):
            total += _bytes(shape, [dtype if dtype in _ITEMSIZE else "float"] * len(shape))  # a list of tensors
    return total


def _dtype_name(dtypes: list[str]) -> str:
    first = next((d for d in dtypes if d in _DTYPE_NAMES), "float")
    return _DTYPE_NAMES[first]


def _attention_flops(key: str, cls: str, tensors: list[list[int]]) -> float:
    """Scaled dot-product attention's FLOPs from its shapes, which the profiler does not count.

    FlopCounterMode's own formulas, which it does not apply to CPU's flash attention: forward from q, k, v (its two
    GEMMs); backward from grad_out, q, k, v (five GEMMs: the scores are recomputed). 0 for shapes they do not take.
    """
    if cls != "attention":
        return 0.0
    backward = "backward" in key
    needed = 4 if backward else 3
    if len(tensors) < needed or any(len(t) != 4 for t in tensors[:needed]):
        return 0.0
    if ("_flash_attention_" in key or "_efficient_attention_" in key) and "scaled_dot_product" not in key:
        # the kernels under aten::_scaled_dot_product_*_attention on CUDA take [batch, seq, heads, dim]
        tensors = [[t[0], t[2], t[1], t[3]] for t in tensors[:needed]]
    try:
        if backward:
            return float(flop_counter.sdpa_backward_flop_count(*tensors[:4]))
        return float(flop_counter.sdpa_flop_count(*tensors[:3]))
    except (AssertionError, ValueError):  # shapes the formula does not take (a mask in their place, say)
        return 0.0


def _conv_backward(tensors: list[list[int]], concrete: list[Any]) -> tuple[float, float]:
    """``(FLOPs, output elements)`` of ``aten::convolution_backward``: FlopCounterMode's formula, its grads as asked."""
    transposed = concrete[7] if len(concrete) > 7 and isinstance(concrete[7], bool) else False
    mask = concrete[10] if len(concrete) > 10 and isinstance(concrete[10], list) else [True, True, False]
    grad_out, x, w = tensors[:3]
    formula = flop_counter.conv_backward_flop.__wrapped__  # type: ignore[attr-defined]  # the formula, unregistered
    flops = formula(grad_out, x, w, None, None, None, None, transposed, None, None, mask, out_shape=[x, w, None])
    return float(flops), mask[0] * math.prod(x) + mask[1] * math.prod(w)


def grouped_mm_work(a: list[int], b: list[int], groups: int = 1) -> tuple[float, float]:
    """``(FLOPs, output elements)`` of ``torch._grouped_mm(a, b, offs=...)`` from its two operands' shapes.

    The groups (experts) are the 3-D operand's first dimension, or the offsets over the 2-D operands' shared one; the
    rows a group takes come from the offsets, so over all groups they add up to the grouped dimension (rows past the
    last offset, padding, are counted too: an upper bound by them).

    Example:
        >>> grouped_mm_work([96, 32], [4, 32, 64])  # 96 tokens over 4 experts, 32 -> 64 each
        (393216.0, 6144.0)
        >>> grouped_mm_work([32, 96], [96, 64], groups=4)  # the weight gradient: one 32 x 64 block per expert
        (393216.0, 8192.0)
    """
    if len(a) == 2 and len(b) == 3:  # (tokens, K) x (G, K, N) -> (tokens, N)
        return 2.0 * a[0] * a[1] * b[2], float(a[0] * b[2])
    if len(a) == 3 and len(b) == 2:  # (G, M, K) x (K, tokens) -> (M, tokens)
        return 2.0 * a[1] * a[2] * b[1], float(a[1] * b[1])
    if len(a) == 3 and len(b) == 3:  # (G, M, K) x (G, K, N): batched
        return 2.0 * a[0] * a[1] * a[2] * b[2], float(a[0] * a[1] * b[2])
    if len(a) == 2 and len(b) == 2:  # (M, tokens) x (tokens, N) -> (G, M, N), G from the offsets
        return 2.0 * a[0] * a[1] * b[1], float(groups * a[0] * b[1])
    return 0.0, 0.0


class UnrecordedShapes(ValueError):
    """A GEMM whose operands' shapes the trace did not all record: its time is known, its work is not."""


def _gemm_like(key: str, cls: str, event: Any, tensors: list[list[int]]) -> tuple[float, float]:
    """``(FLOPs, output elements)`` of a matmul, conv or attention op."""
    flops = float(event.flops or 0)
    if key.endswith("_scaled_mm") and not flops and len(tensors) >= 2 and len(tensors[0]) == len(tensors[1]) == 2:
        # float8 GEMMs (torchao's): the profiler counts none; (M, K) x (K, N), the scales beside them do no work
        (m, k), n = tensors[0], tensors[1][1]
        return 2.0 * m * k * n, float(m * n)
    if "grouped_mm" in key and len(tensors) >= 2:  # the profiler counts no FLOPs for it
        offsets = tensors[2] if len(tensors) > 2 and len(tensors[2]) == 1 else [1]
        return grouped_mm_work(tensors[0], tensors[1], offsets[0])
    if cls == "attention":
        return flops or _attention_flops(key, cls, tensors), math.prod(tensors[0])
    if cls == "conv" and not flops and "backward" in key and len(tensors) >= 3:
        return _conv_backward(tensors, list(getattr(event, "concrete_inputs", None) or []))
    if cls == "conv" and len(tensors) >= 2:
        return flops, flops / (2 * math.prod(tensors[1][1:]) or 1)  # each output element: 2 C_in k_h k_w FLOPs
    if len(tensors) >= 2 and len(tensors[-1]) >= 2 and len(tensors) < 4 and not key.endswith("_out"):
        if len(tensors[-2]) < 2:  # the left operand's shape is missing (an addmm's bias stands in its place): no m
            raise UnrecordedShapes(key)
        return flops, tensors[-2][-2] * tensors[-1][-1] * math.prod(tensors[-2][:-2] or [1])  # m x n (x batch)
    return flops, 0.0  # ``addmm``'s out= already sits among its inputs


def _op_work(key: str, cls: str, event: Any) -> tuple[float, float, str] | None:
    """``(FLOPs, bytes, dtype)`` of one op that does its class's work, from its shapes; ``None`` without any."""
    shapes, dtypes = list(event.input_shapes or []), list(getattr(event, "input_dtypes", None) or [])
    tensors = [s for s in shapes if isinstance(s, list) and s and all(isinstance(d, int) for d in s)]
    if not tensors:
        return None
    itemsize = _ITEMSIZE.get(dtypes[0] if dtypes else "float", 4)
    if cls in GEMM_CLASSES:
        flops, out = _gemm_like(key, cls, event, tensors)
        return flops, _bytes(shapes, dtypes) + out * itemsize, _dtype_name(dtypes)
    touched = _gathered(key, shapes, dtypes)
    if touched is not None:  # reads only the rows its indices pick, not the whole table
        return (_FLOPS_PER_ELEMENT.get(cls, 1.0) * touched, 2 * touched * itemsize + 8 * math.prod(tensors[-1]),
                _dtype_name(dtypes))
    out = math.prod(tensors[0])
    return _FLOPS_PER_ELEMENT.get(cls, 1.0) * out, _bytes(shapes, dtypes) + out * itemsize, _dtype_name(dtypes)


def _gathered(key: str, shapes: list[Any], dtypes: list[str]) -> float | None:
    """Elements a gather-like op touches (an embedding's picked rows, a loss's picked logits); ``None`` else."""
    name = key.rsplit("::", 1)[-1]
    tensors = [s for s in shapes if isinstance(s, list) and s and all(isinstance(d, int) for d in s)]
    if name.startswith("nll_loss"):  # forward and backward read or write one logit per target
        targets = [s for s, d in zip(shapes, dtypes) if d == "long int" and isinstance(s, list) and s]
        return float(math.prod(targets[0])) if targets else None
    if len(tensors) < 2 or "backward" in name:
        return None
    if name in ("embedding", "index_select"):
        return math.prod(tensors[1]) * math.prod(tensors[0][1:])
    if name in ("gather", "take"):
        return float(math.prod(tensors[-1]))
    return None


class _Tree:
    """Which events of a profile do their class's work: each op once, never a wrapper and its child both."""

    def __init__(self) -> None:
        self._classes: dict[str, str] = {}

    def cls(self, key: str) -> str:
        if key not in self._classes:
            self._classes[key] = classify_profiler_event(key)
        return self._classes[key]

    def _related(self, event: Any, cls: str) -> bool:
        return self.cls(event.key) in (cls, *GEMM_CLASSES)

    def does_work(self, event: Any, cls: str) -> bool:
        """The outermost op the profiler counted FLOPs for (``aten::conv2d`` over its chain), else the innermost.

        Innermost: ``aten::addmm`` under ``aten::linear``, the math path's ``bmm`` under attention.
        """
        parent = event.cpu_parent
        while parent is not None:
            if parent.flops and self._related(parent, cls):
                return False  # counted at that ancestor
            parent = parent.cpu_parent
        return bool(event.flops) or not any(self._related(c, cls) for c in event.cpu_children)


def achieved_rates(rows: dict[str, ClassRoofline], min_seconds: float = 1e-3) -> dict[str, float]:
    """Per dtype, the highest TFLOP/s an op class reached in it (classes of one dtype, timed ``min_seconds`` or more).

    A class of a few microseconds is left out: the clock's granularity alone could put it above any peak.

    Example:
        >>> rows = {"norm": ClassRoofline("norm", {"fp32": 4e9}, bytes=1e9, seconds=0.01, calls=4),
        ...         "matmul": ClassRoofline("matmul", {"fp32": 1e9}, bytes=1e6, seconds=1e-6, calls=1)}
        >>> achieved_rates(rows)
        {'fp32': 0.4}
    """
    rates: dict[str, float] = {}
    for row in rows.values():
        if len(row.flops_by_dtype) == 1 and row.seconds >= min_seconds and row.calls:
            (dtype,) = row.flops_by_dtype
            rates[dtype] = max(rates.get(dtype, 0.0), row.tflops)
    return rates


def class_rooflines(prof: Any, use_device: bool = False) -> dict[str, ClassRoofline]:
    """Per op class of a stopped profiler: FLOPs per dtype, bytes and self time, from the leaf ops that did the work.

    GEMM and forward convolution FLOPs are the profiler's own (``with_flops``); attention's and convolution
    backward's come from their shapes through FlopCounterMode's formulas; elementwise-like classes count
    :data:`_FLOPS_PER_ELEMENT` per element of their first input. Bytes are the inputs' sizes plus the output's (a
    GEMM's ``m x n``, a convolution's from its FLOPs, else the first input's size). Wrappers (``aten::linear``
    around ``aten::addmm``) add their time but not their work (:class:`_Tree`), so nothing counts twice. Inductor's
    fused kernels, and GEMMs whose operands' shapes the trace lacks, count their time with their class (as the
    op-class shares do) in ``unknown_seconds``. The
    ``communication`` row holds the bytes the collectives were handed.

    Args:
        prof: a profiler run with ``record_shapes=True`` (and ``with_flops=True`` for GEMM and conv FLOPs).
        use_device: take device (CUDA) self time instead of CPU self time.
    """
    rows: dict[str, ClassRoofline] = {}
    tree = _Tree()
    for e in window_events(prof):
        key = e.key
        if is_framework_event(key) or on_device(e):
            continue  # a kernel's device time is its launching op's self device time: counted there, once
        cls = tree.cls(key)
        seconds = float(e.self_device_time_total if use_device else e.self_cpu_time_total) / 1e6
        if cls == "communication":
            _add_communication(rows, e, tree)
            continue
        if cls in NO_ARITHMETIC:
            continue
        row = rows.setdefault(cls, ClassRoofline(cls))
        if fused_kernel_ops(key) is not None:
            row.unknown_seconds += seconds
            row.unknown_calls += 1
            continue
        # A wrapper's own time (aten::linear around aten::addmm) and that of ops with no tensor inputs is the class's
        # dispatch cost: time without work of its own, so the class's time is the op-class share's, to the microsecond
        try:
            work = _op_work(key, cls, e) if tree.does_work(e, cls) else None
        except UnrecordedShapes:
            row.unknown_seconds += seconds
            row.unknown_calls += 1
            row.unrecorded_calls += 1
            continue
        row.seconds += seconds
        if work is None:
            continue
        flops, moved, dtype = work
        row.flops_by_dtype[dtype] = row.flops_by_dtype.get(dtype, 0.0) + flops
        row.bytes += moved
        row.calls += 1
    return {cls: row for cls, row in rows.items() if row.seconds or row.unknown_seconds or row.bytes}


def _add_communication(rows: dict[str, ClassRoofline], event: Any, tree: _Tree) -> None:
    parent = event.cpu_parent
    if parent is not None and tree.cls(parent.key) == "communication" or event.key in _NOT_TRANSFERS:
        return  # gloo:all_reduce inside c10d::allreduce_: the outermost collective counts its bytes once
    moved = _bytes(list(event.input_shapes or []), list(getattr(event, "input_dtypes", None) or []))
    if moved:
        row = rows.setdefault("communication", ClassRoofline("communication"))
        row.bytes += moved
        row.calls += 1
