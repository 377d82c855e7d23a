"""Where each op class stands against this device: measured peaks, work per class, achieved rates and the bound.

Trainer-free, over a stopped ``torch.profiler`` run with ``record_shapes=True`` (and ``with_flops=True`` for the
profiler's own GEMM and convolution counts). A first part of issue 19: not yet logged by ProfilerWindows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from lightning_opkit.opclass import classify_profiler_event, is_framework_event

__all__ = ["ClassRoofline", "Peaks", "class_rooflines", "measure_peaks"]

_ITEMSIZE = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "BFloat16": 2, "Half": 2, "long int": 8,
             "int": 4, "bool": 1, "unsigned char": 1, "signed char": 1, "short int": 2}
#: arithmetic per element of the elementwise-like classes (a LayerNorm reads, centres, squares, sums, scales)
_FLOPS_PER_ELEMENT = {"norm": 8.0, "softmax": 5.0, "activation": 8.0, "loss": 4.0, "reduction": 1.0,
                      "pointwise": 1.0, "embedding": 0.0, "copy": 0.0}
_PEAKS: dict[tuple[str, tuple[str, ...]], Peaks] = {}


@dataclass(frozen=True)
class Peaks:
    """This device's measured peaks: dense GEMM TFLOP/s per dtype name, and memory bandwidth in GB/s."""

    device: str
    gemm_tflops: dict[str, float]
    bandwidth_gbps: float


def _timed(fn: Any, device: torch.device, reps: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    best = math.inf
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_peaks(device: torch.device | str = "cpu", dtypes: tuple[str, ...] = ("fp32", "bf16"),
                  n: int | None = None) -> Peaks:
    """Dense GEMM throughput per dtype at a large square shape, and copy bandwidth; measured once per process.

    Args:
        device: the training device.
        dtypes: dtype names to time (``"fp32"``, ``"bf16"``, ``"fp16"``).
        n: the GEMM's size (default 1024 on CPU, 8192 on CUDA).

    Example:
        >>> peaks = measure_peaks("cpu", ("fp32",), n=256)
        >>> peaks.gemm_tflops["fp32"] > 0 and peaks.bandwidth_gbps > 0
        True
    """
    device = torch.device(device)
    key = (f"{device}:{n}", tuple(dtypes))
    if key in _PEAKS:
        return _PEAKS[key]
    size = n or (8192 if device.type == "cuda" else 1024)
    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    tflops = {}
    for name in dtypes:
        a = torch.randn(size, size, device=device).to(names[name])
        seconds = _timed(lambda a=a: a @ a, device, reps=3)
        tflops[name] = 2 * size**3 / seconds / 1e12
    src = torch.empty(64 * 2**20 if device.type == "cpu" else 256 * 2**20, device=device)  # 256 MB / 1 GB of fp32
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device, reps=3)
    peaks = _PEAKS[key] = Peaks(str(device), tflops, 2 * src.numel() * 4 / seconds / 1e9)
    return peaks


@dataclass
class ClassRoofline:
    """One op class in one window: its work, its time, its rates against the peaks, and what bounds it."""

    op_class: str
    dtype: str
    flops: float
    bytes: float
    seconds: float

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

    def bound(self, peaks: Peaks) -> tuple[str, float]:
        """``(what bounds it, % of that roof)``: compute, memory, or overhead (under 10% of its roof)."""
        compute = peaks.gemm_tflops.get(self.dtype, peaks.gemm_tflops.get("fp32", 0.0)) * 1e12
        memory = peaks.bandwidth_gbps * 1e9
        ridge = compute / memory if memory else math.inf
        kind = "compute" if self.intensity >= ridge else "memory"
        roof = compute if kind == "compute" else self.intensity * memory
        achieved = self.flops / self.seconds if self.seconds else 0.0
        pct = 100 * achieved / roof if roof else 0.0
        if kind == "memory" and self.flops == 0:
            pct = 100 * self.gbps / peaks.bandwidth_gbps if peaks.bandwidth_gbps else 0.0
        return ("overhead" if pct < 10 else kind), pct


def _bytes(shapes: list[Any], dtypes: list[str]) -> float:
    total = 0.0
    for shape, dtype in zip(shapes, dtypes):
        if isinstance(shape, list) and shape and all(isinstance(d, int) for d in shape):
            total += math.prod(shape) * _ITEMSIZE.get(dtype, 4)
    return total


def _dtype_name(dtypes: list[str]) -> str:
    first = next((d for d in dtypes if d in ("float", "c10::BFloat16", "c10::Half", "double")), "float")
    return {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "double": "fp64"}[first]


def _attention_flops(key: str, cls: str, tensors: list[list[int]]) -> float:
    """Scaled dot-product attention's FLOPs from its shapes, which the profiler does not count.

    From q ``[..., L, D]`` and k ``[..., S, D]``: its two GEMMs, 4 L S D per head forward; backward counted as twice
    that.
    """
    if cls != "attention" or len(tensors) < 2 or len(tensors[0]) < 2 or len(tensors[1]) < 2:
        return 0.0
    q, k = tensors[0], tensors[1]
    forward = 4.0 * math.prod(q[:-1]) * k[-2] * q[-1]
    return 2 * forward if "backward" in key else forward


def class_rooflines(prof: Any) -> dict[str, ClassRoofline]:
    """Per op class of a stopped profiler: FLOPs, bytes, self time and dtype, from the leaf ops that did the work.

    GEMM and convolution FLOPs are the profiler's own (``with_flops``), attention's from its shapes
    (:func:`_attention_flops`); elementwise-like classes count
    :data:`_FLOPS_PER_ELEMENT` per element of their first input; bytes are the inputs' sizes plus an output the size
    of the first input (a GEMM's output, ``m x n``, instead). Wrappers (``aten::linear`` around ``aten::addmm``) are
    left out, so nothing counts twice.

    Args:
        prof: a profiler run with ``record_shapes=True``.
    """
    rows: dict[str, ClassRoofline] = {}
    for e in prof.events():
        key = e.key
        if is_framework_event(key):
            continue
        cls = classify_profiler_event(key)
        if cls in ("other", "layout", "communication"):
            continue
        if any(classify_profiler_event(c.key) == cls for c in e.cpu_children):
            continue  # a wrapper (aten::linear around aten::addmm): its child does the work
        shapes, dtypes = list(e.input_shapes or []), list(getattr(e, "input_dtypes", None) or [])
        tensors = [s for s in shapes if isinstance(s, list) and s]
        if not tensors:
            continue
        moved = _bytes(shapes, dtypes)
        flops = float(e.flops or 0) or _attention_flops(key, cls, tensors)
        itemsize = _ITEMSIZE.get(dtypes[0] if dtypes else "float", 4)
        if flops and len(tensors) >= 2 and len(tensors[-1]) >= 2 and len(tensors[-2]) >= 2:
            moved += tensors[-2][-2] * tensors[-1][-1] * itemsize * math.prod(tensors[-2][:-2] or [1])
        else:
            moved += math.prod(tensors[0]) * itemsize
            flops = flops or _FLOPS_PER_ELEMENT.get(cls, 1.0) * math.prod(tensors[0])
        row = rows.setdefault(cls, ClassRoofline(cls, _dtype_name(dtypes), 0.0, 0.0, 0.0))
        row.flops += flops
        row.bytes += moved
        row.seconds += float(e.self_cpu_time_total) / 1e6
    return rows
