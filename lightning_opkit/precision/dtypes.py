"""Dtype names, the op classes the policy may cast, and what this device's hardware offers for each dtype."""

from __future__ import annotations

import functools
import platform
from typing import Literal, get_args

import torch

from lightning_opkit.core.dtypes import BY_NAME, cast
from lightning_opkit.opclass import GOVERNED, NEVER_CAST

#: what the LightningCLI checks at parse time: a typo in a dtype or an op class fails there, naming the value
DtypeName = Literal["fp32", "bf16", "fp16", "fp8", "keep"]
OpClassName = Literal["matmul", "conv", "attention", "norm", "softmax", "activation", "loss", "reduction", "pointwise",
                      "embedding", "rnn"]

#: the policy's dtype names -> dtype (``"keep"``: the op is left alone)
DTYPES: dict[str, torch.dtype | None] = {**{n: BY_NAME[n] for n in ("fp32", "bf16", "fp16")}, "keep": None}
LOW = (torch.bfloat16, torch.float16)
#: ``"fp8"`` is a GEMM dtype (:mod:`~lightning_opkit.precision.fp8`): a Linear's matmul in float8. Every other op of a
#: class or module set to it, and each Linear float8 cannot take, runs in this dtype: the "next" one down.
FP8_NEXT = "bf16"
#: the policy's dtype name for float8 GEMMs
FP8 = "fp8"
#: every dtype name a rule or override may give: the cast dtypes, ``"fp8"`` and ``"keep"``
NAMES = ["fp32", "bf16", "fp16", "fp8", "keep"]


def mode_dtype(name: str) -> torch.dtype | None:
    """The dtype the policy's mode casts an op to for dtype name ``name`` (``"fp8"``: :data:`FP8_NEXT`'s).

    Example:
        >>> mode_dtype("fp8"), mode_dtype("keep")
        (torch.bfloat16, None)
    """
    return DTYPES[FP8_NEXT if name == "fp8" else name]

__all__ = ["DTYPES", "FP8", "FP8_NEXT", "GOVERNED", "LOW", "NAMES", "NEVER_CAST", "DtypeName", "OpClassName", "cast",
           "describe_device", "hardware_note", "mode_dtype"]

assert set(get_args(OpClassName)) == set(GOVERNED)
assert get_args(DtypeName) == tuple(NAMES)
assert set(NAMES) == {*DTYPES, "fp8"}


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def hardware_note(device: torch.device | str, dtype: str) -> str:
    """Why ``dtype`` may be slow or fast on ``device``, from what the hardware reports (not a measurement).

    Args:
        device: the training device.
        dtype: ``"bf16"`` or ``"fp16"``.

    Example:
        >>> hardware_note("cpu", "fp32")
        ''
    """
    device = torch.device(device)
    if dtype not in ("bf16", "fp16"):
        return ""
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        if dtype == "bf16" and major < 8:
            return f"no bf16 Tensor Cores (compute capability {major}.{minor} < 8.0)"
        if dtype == "fp16" and major < 7:
            return f"no fp16 Tensor Cores (compute capability {major}.{minor} < 7.0)"
        return f"{dtype} Tensor Cores (compute capability {major}.{minor})"
    if device.type == "cpu":
        flags = _cpu_flags()
        if not flags:
            return f"{platform.machine()} CPU; its {dtype} support is unknown here"
        native = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}[dtype]
        have = [f for f in native if f in flags]
        if have:
            return f"native {dtype} units ({', '.join(have)})"
        return f"no native {dtype} units ({torch.backends.cpu.get_cpu_capability()} only, no {'/'.join(native)})"
    return ""


def describe_device(device: torch.device | str, hardware: bool = True) -> str:
    """A one-line description of ``device`` for reports: its name and (``hardware``) its bf16 hardware.

    Args:
        device: the training device.
        hardware: add what the hardware offers for bf16.
    """
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
        except OSError:
            pass
        name = f"{name}, {torch.get_num_threads()} threads"
    return f"{device.type}: {name}" + (f"; bf16: {hardware_note(device, 'bf16')}" if hardware else "")
