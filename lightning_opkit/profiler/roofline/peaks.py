"""This device's peaks, measured once per process: dense GEMM TFLOP/s per dtype, copy bandwidth, an all_reduce.

The roofs :mod:`~lightning_opkit.profiler.roofline.work` judges each op class against; on known GPUs the
datasheet's figures sit beside the measured ones.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Peaks", "datasheet_peaks", "measure_link", "measure_peaks"]

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
_PEAKS: dict[tuple[str, str], tuple[float, int]] = {}
_BANDWIDTH: dict[str, float] = {}

# NVIDIA's datasheet figures: dense Tensor Core TFLOP/s (no sparsity) and HBM GB/s. "fp32" is TF32 where matmuls
# may use it (torch.backends.cuda.matmul.allow_tf32), else plain FP32. Matched on torch.cuda.get_device_name().
_DATASHEETS: tuple[tuple[str, dict[str, float], float], ...] = (
    ("H200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0, "fp8": 1979.0}, 4800.0),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0, "fp8": 1513.0}, 2000.0),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0, "fp8": 1979.0}, 3350.0),
    ("A100-SXM4-80GB", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 2039.0),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 1555.0),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3, "fp8": 242.0}, 300.0),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}, 600.0),
)


@dataclass(frozen=True)
class Peaks:
    """This device's peaks as measured in this process, with the datasheet's beside them where the device is known.

    ``gemm_tflops`` holds dense GEMM TFLOP/s per dtype name and ``gemm_size`` the square size each was timed at;
    ``bandwidth_gbps`` is a large copy's read + write GB/s; ``link_gbps`` an all_reduce's bytes per second across the
    process group (``None`` on one process).
    """

    device: str
    gemm_tflops: dict[str, float]
    bandwidth_gbps: float
    gemm_size: dict[str, int] = field(default_factory=dict)
    link_gbps: float | None = None
    datasheet_tflops: dict[str, float] = field(default_factory=dict)
    datasheet_gbps: float | None = None

    def peak(self, dtype: str) -> float:
        """The measured GEMM peak of ``dtype`` in FLOP/s (fp32's for a dtype not measured)."""
        return self.gemm_tflops.get(dtype, self.gemm_tflops.get("fp32", 0.0)) * 1e12

    def describe(self) -> str:
        """One line: what was measured, where, at what size; the datasheet beside it."""
        gemms = ", ".join(f"{d} {t:.3g} TFLOP/s ({self.gemm_size.get(d, 0)}^3)" for d, t in self.gemm_tflops.items())
        text = f"measured on {self.device}: dense GEMM {gemms}; copy {self.bandwidth_gbps:.1f} GB/s"
        if self.link_gbps is not None:
            text += f"; all_reduce {self.link_gbps:.2f} GB/s"
        if self.datasheet_tflops:
            sheet = ", ".join(f"{d} {t:g}" for d, t in self.datasheet_tflops.items())
            text += f" (datasheet: {sheet} TFLOP/s, {self.datasheet_gbps:g} GB/s)"
        return text


def _timed(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
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


def _gemm_peak(device: torch.device, dtype: str, n: int | None) -> tuple[float, int]:
    """Best TFLOP/s of ``a @ a``, and the size that reached it.

    At ``n``, else over sizes doubling from 256 (1024 on CUDA) until one GEMM takes 20 ms or the size reaches 2048
    (8192).
    """
    size = n or (1024 if device.type == "cuda" else 256)
    cap = n or (8192 if device.type == "cuda" else 2048)
    best = (0.0, size)
    while True:
        a = torch.randn(size, size, device=device).to(_TORCH_DTYPES[dtype])
        seconds = _timed(lambda a=a: a @ a, device, reps=2)
        best = max(best, (2 * size**3 / seconds / 1e12, size))
        if size >= cap or seconds > 0.02:
            # a slow dtype (bf16 emulated on a CPU without bf16 units) stops at a small size, in well under a second
            return best
        size *= 2


def _datasheet(device: torch.device) -> tuple[dict[str, float], float | None]:
    if device.type != "cuda":
        return {}, None
    name = torch.cuda.get_device_name(device)
    for key, tflops, gbps in _DATASHEETS:
        if key in name:
            sheet = dict(tflops)
            tf32 = sheet.pop("tf32")
            if torch.backends.cuda.matmul.allow_tf32:
                sheet["fp32"] = tf32
            return sheet, gbps
    return {}, None


def datasheet_peaks(device: torch.device | str) -> tuple[dict[str, float], float | None]:
    """The datasheet's dense TFLOP/s per dtype and memory GB/s of a known GPU (``({}, None)`` elsewhere).

    Example:
        >>> datasheet_peaks("cpu")
        ({}, None)
    """
    return _datasheet(torch.device(device))


def measure_peaks(device: torch.device | str = "cpu", dtypes: tuple[str, ...] = ("fp32", "bf16"),
                  n: int | None = None, link_gbps: float | None = None) -> Peaks:
    """Dense GEMM throughput per dtype and copy bandwidth on ``device``; each measured once per process, cached.

    Args:
        device: the training device.
        dtypes: dtype names to time (``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp64"``).
        n: time the GEMM at this size only (default: doubling from 256 on CPU / 1024 on CUDA until one GEMM takes
            20 ms or reaches 2048 / 8192).
        link_gbps: the process group's measured all_reduce bandwidth, from :func:`measure_link`.

    Example:
        >>> peaks = measure_peaks("cpu", ("fp32",), n=256)
        >>> peaks.gemm_tflops["fp32"] > 0 and peaks.bandwidth_gbps > 0, peaks.gemm_size
        (True, {'fp32': 256})
    """
    device = torch.device(device)
    tflops, sizes = {}, {}
    for name in dict.fromkeys(dtypes):
        if name not in _TORCH_DTYPES:
            continue
        key = (f"{device}:{n}", name)
        if key not in _PEAKS:
            _PEAKS[key] = _gemm_peak(device, name, n)
        tflops[name], sizes[name] = _PEAKS[key]
    if str(device) not in _BANDWIDTH:
        src = torch.empty(64 * 2**20 if device.type == "cpu" else 256 * 2**20, device=device)  # 256 MB / 1 GB fp32
        dst = torch.empty_like(src)
        _BANDWIDTH[str(device)] = 2 * src.numel() * 4 / _timed(lambda: dst.copy_(src), device, reps=3) / 1e9
        del src, dst
    sheet, sheet_gbps = _datasheet(device)
    return Peaks(str(device), tflops, _BANDWIDTH[str(device)], sizes, link_gbps, sheet, sheet_gbps)


def measure_link(device: torch.device, megabytes: int = 16) -> float | None:
    """An all_reduce's bytes per second (of its buffer) across the default process group; ``None`` on one process.

    A collective: every rank must call it, at the same point.

    Args:
        device: where the buffer goes (NCCL reduces CUDA tensors only).
        megabytes: the buffer's size.

    Example:
        >>> measure_link(torch.device("cpu")) is None  # no process group
        True
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    buffer = torch.zeros(megabytes * 2**18, device=device)
    seconds = _timed(lambda: dist.all_reduce(buffer), device, reps=3)
    return buffer.numel() * 4 / seconds / 1e9
