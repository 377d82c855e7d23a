"""This device's peaks, measured once per process: dense GEMM TFLOP/s per dtype, copy bandwidth, an all_reduce.

The roofs :mod:`~lightning_opkit.profiler.roofline.work` judges each op class against; on known GPUs the
datasheet's figures sit beside the measured ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_opkit.core.dtypes import BY_NAME
from lightning_opkit.core.timing import best_seconds, filled_seconds

__all__ = ["Peaks", "checked_peaks", "datasheet", "datasheet_peaks", "measure_link", "measure_peaks", "tf32_matmuls"]

# (device, size asked, dtype, TF32 allowed) -> (TFLOP/s, size): a later change of the fp32 matmul precision is a new
# peak, measured again
_PEAKS: dict[tuple[str, int | None, str, bool], tuple[float, int]] = {}
_BANDWIDTH: dict[str, float] = {}
# (device, dtype) whose peak a window outran and was measured again: once per process, later windows only say so
_CHECKED: set[tuple[str, str]] = set()

# NVIDIA's datasheet figures: dense Tensor Core TFLOP/s (half the "with sparsity" figures) and HBM GB/s. "fp32" is
# TF32 where matmuls may use it (:func:`tf32_matmuls`), else plain FP32. Matched in order on
# torch.cuda.get_device_name(): the first key the name contains wins, so variants come before the family ("GH200"
# before "H200", "H100 NVL" before "H100").
_HOPPER_SXM = {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0, "fp8": 1979.0}
_HOPPER_NVL = {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0, "fp8": 1670.0}
_AMPERE = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}
_DATASHEETS: tuple[tuple[str, dict[str, float], float], ...] = (
    ("GH200", _HOPPER_SXM, 4000.0),  # the 96 GB HBM3 part; the 144 GB HBM3e one reaches 4900
    ("H200 NVL", _HOPPER_NVL, 4800.0),
    ("H200", _HOPPER_SXM, 4800.0),
    ("H100 NVL", _HOPPER_NVL, 3900.0),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0, "fp8": 1513.0}, 2000.0),
    ("H100", _HOPPER_SXM, 3350.0),
    ("A100-SXM4-80GB", _AMPERE, 2039.0),
    ("A100 80GB PCIe", _AMPERE, 1935.0),
    ("A100", _AMPERE, 1555.0),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3, "fp8": 242.0}, 300.0),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}, 600.0),
)


def tf32_matmuls() -> bool:
    """Whether CUDA fp32 matmuls may run on TF32 Tensor Cores now.

    Read through the ``fp32_precision`` API where torch has it: since torch 2.9, once anything (transformers does) sets
    it, reading the legacy ``allow_tf32`` or ``get_float32_matmul_precision()`` can raise for mixing the two APIs.

    Example:
        >>> tf32_matmuls() in (True, False)
        True
    """
    matmul = torch.backends.cuda.matmul
    try:
        mode = getattr(matmul, "fp32_precision", None)
        if mode == "none":  # inherits the generic setting
            mode = getattr(torch.backends, "fp32_precision", "ieee")
        if mode is not None:
            return mode == "tf32"
    except RuntimeError:
        pass
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # the two APIs mixed: TF32 unknown; fp32's own (lower) peak is the safe roof
        return False


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
    #: dtype -> why its peak looks disturbed (an op class ran faster than it, even measured again): shares of it are
    #: unreliable
    disturbed: dict[str, str] = field(default_factory=dict)

    def peak(self, dtype: str) -> float:
        """The GEMM peak of ``dtype`` in FLOP/s: measured, else the datasheet's, else 0 (unknown).

        An unknown peak is never another dtype's: fp8 FLOPs judged against the fp32 peak would read as an MFU many
        times too high. Work in a dtype with no peak stays out of MFU and ``% of peak``.
        """
        return self.gemm_tflops.get(dtype, self.datasheet_tflops.get(dtype, 0.0)) * 1e12

    def describe(self) -> str:
        """One line: what was measured, where, at what size; the datasheet beside it."""
        gemms = ", ".join(f"{d} {t:.3g} TFLOP/s ({self.gemm_size.get(d, 0)}^3)" for d, t in self.gemm_tflops.items())
        text = f"measured on {self.device}: dense GEMM {gemms}; copy {self.bandwidth_gbps:.1f} GB/s"
        if self.link_gbps is not None:
            text += f"; all_reduce {self.link_gbps:.2f} GB/s"
        if self.datasheet_tflops:
            sheet = ", ".join(f"{d} {t:g}" for d, t in self.datasheet_tflops.items())
            text += f" (datasheet: {sheet} TFLOP/s, {self.datasheet_gbps:g} GB/s)"
        for dtype, why in self.disturbed.items():
            text += f"; {dtype}'s peak looks disturbed ({why}): shares of it are unreliable"
        return text


def _gemm_peak(device: torch.device, dtype: str, n: int | None) -> tuple[float, int]:
    """Best TFLOP/s of ``a @ a``, and the size that reached it.

    At ``n``, else over sizes doubling from 256 (1024 on CUDA) until one GEMM takes 20 ms past 512 (a busy machine
    can stretch a small GEMM past 20 ms) or the size reaches 2048 (8192). Each size is timed as the best of three
    samples of back-to-back GEMMs filling about 10 ms (on CUDA between two events), so a GEMM's launch and a
    synchronization do not count as its time.
    """
    size = n or (1024 if device.type == "cuda" else 256)
    cap = n or (8192 if device.type == "cuda" else 2048)
    best = (0.0, size)
    while True:
        a = torch.randn(size, size, device=device).to(BY_NAME[dtype])
        gemm = functools.partial(torch.matmul, a, a)
        seconds = filled_seconds(gemm, device, fill_s=0.01)
        best = max(best, (2 * size**3 / seconds / 1e12, size))
        del a, gemm
        if size >= cap or (seconds > 0.02 and size >= 512):
            # a slow dtype (bf16 emulated on a CPU without bf16 units) stops at a small size, in well under a second
            return best
        size *= 2


def datasheet(name: str, tf32: bool = False) -> tuple[dict[str, float], float | None]:
    """The datasheet's dense TFLOP/s per dtype and memory GB/s of the GPU named ``name`` (``({}, None)``: unknown).

    Args:
        name: as ``torch.cuda.get_device_name()`` gives it.
        tf32: fp32 matmuls may use TF32 (then "fp32" is the TF32 Tensor Core figure).

    Example:
        >>> datasheet("NVIDIA GH200 480GB")[1], datasheet("NVIDIA A100 80GB PCIe")[1], datasheet("Radeon")
        (4000.0, 1935.0, ({}, None))
        >>> datasheet("NVIDIA H100 80GB HBM3", tf32=True)[0]["fp32"]
        494.0
    """
    for key, tflops, gbps in _DATASHEETS:
        if key in name:
            sheet = dict(tflops)
            tf32_figure = sheet.pop("tf32")
            if tf32:
                sheet["fp32"] = tf32_figure
            return sheet, gbps
    return {}, None


def _datasheet(device: torch.device) -> tuple[dict[str, float], float | None]:
    if device.type != "cuda":
        return {}, None
    return datasheet(torch.cuda.get_device_name(device), tf32_matmuls())


def datasheet_peaks(device: torch.device | str) -> tuple[dict[str, float], float | None]:
    """The datasheet's dense TFLOP/s per dtype and memory GB/s of a known GPU (``({}, None)`` elsewhere).

    Example:
        >>> datasheet_peaks("cpu")
        ({}, None)
    """
    return _datasheet(torch.device(device))


@contextlib.contextmanager
def _returning_memory(device: torch.device) -> Iterator[None]:
    """Inside, CUDA memory may be taken; what the caching allocator reserved for it is handed back on exit.

    Peaks are measured once, mid-training: gigabytes of GEMM operands and copy buffers would otherwise stay reserved
    beside the model for the rest of the run.
    """
    before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    try:
        yield
    finally:
        if device.type == "cuda" and torch.cuda.memory_reserved(device) > before:
            torch.cuda.empty_cache()


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
    tf32 = device.type == "cuda" and tf32_matmuls()
    tflops, sizes = {}, {}
    with _returning_memory(device):
        for name in dict.fromkeys(dtypes):
            if name not in BY_NAME:
                continue  # fp8 and the like: the datasheet's figure, where the device is known
            key = (str(device), n, name, tf32 and name == "fp32")
            if key not in _PEAKS:
                _PEAKS[key] = _gemm_peak(device, name, n)
            tflops[name], sizes[name] = _PEAKS[key]
        if str(device) not in _BANDWIDTH:
            src = torch.empty(64 * 2**20 if device.type == "cpu" else 256 * 2**20, device=device)  # 256 MB / 1 GB
            dst = torch.empty_like(src)
            _BANDWIDTH[str(device)] = 2 * src.numel() * 4 / best_seconds(lambda: dst.copy_(src), device, reps=3) / 1e9
            del src, dst
    sheet, sheet_gbps = _datasheet(device)
    return Peaks(str(device), tflops, _BANDWIDTH[str(device)], sizes, link_gbps, sheet, sheet_gbps)


def checked_peaks(peaks: Peaks, rates: dict[str, float], device: torch.device | str, tries: int = 2) -> Peaks:
    """``peaks`` checked against what ran: a dtype's GEMM peak that an op class outran is measured again.

    No op runs faster than a dense GEMM of its dtype, so a class that did was timed against a peak measured while the
    machine was busy. That peak is measured again (``tries`` times at most, once per process, the best kept for the
    rest of it); one still outrun is named in ``disturbed``, and every share of it is said to be unreliable.

    Args:
        peaks: the peaks the window would be judged against.
        rates: dtype -> the highest TFLOP/s any op class of the window reached in it.
        device: where they were measured.
        tries: measurements again at most.

    Example:
        >>> peaks = Peaks("cpu", {"fp32": 1e-9}, 10.0, {"fp32": 256})  # as if measured on a machine at full load
        >>> checked_peaks(peaks, {"fp32": 1e-6}, "cpu").gemm_tflops["fp32"] > 1e-9
        True
    """
    device = torch.device(device)
    tflops, sizes, disturbed = dict(peaks.gemm_tflops), dict(peaks.gemm_size), dict(peaks.disturbed)
    for dtype, rate in rates.items():
        if dtype not in tflops or rate <= tflops[dtype]:
            continue
        key = (str(device), None, dtype, device.type == "cuda" and tf32_matmuls() and dtype == "fp32")
        if key in _PEAKS and _PEAKS[key][0] > tflops[dtype]:  # this process measured it higher already
            tflops[dtype], sizes[dtype] = _PEAKS[key]
        # measured again once per process: a later window outrunning it too only says so, and pays nothing
        again_tries = 0 if rate <= tflops[dtype] or (str(device), dtype) in _CHECKED else tries
        if again_tries:
            _CHECKED.add((str(device), dtype))
        for _ in range(again_tries):
            again = _gemm_peak(device, dtype, None)
            best = max(again, (tflops[dtype], sizes.get(dtype, again[1])))
            tflops[dtype], sizes[dtype] = best
            _PEAKS[key] = best
            if rate <= best[0]:
                break
        if rate > tflops[dtype]:
            disturbed[dtype] = f"an op class ran at {rate:.3g} TFLOP/s, above it"
    return dataclasses.replace(peaks, gemm_tflops=tflops, gemm_size=sizes, disturbed=disturbed)


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
    seconds = best_seconds(lambda: dist.all_reduce(buffer), device, reps=3)
    return buffer.numel() * 4 / seconds / 1e9
