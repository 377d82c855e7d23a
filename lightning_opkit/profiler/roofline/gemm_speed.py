"""bf16 against fp32 at this model's own GEMM shapes, from a window's recorded ops: the roofline's precision evidence.

A GEMM peak comes from one large square product; whether bf16 pays at a model's shapes is another question (on a CPU
with bf16 units a 64-wide GEMM measured slower in bf16 while the square peak was 4.6x faster). Where no precision
policy measured the model, the roofline times the window's costliest fp32 GEMM shapes itself, in fp32 and in bf16 with
the input casts a policy would add, back to back on the device's clock, and keeps the result for the run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_opkit.core.dtypes import BY_NAME, PROFILER_DTYPES
from lightning_opkit.core.facts import SpeedFact
from lightning_opkit.core.timing import at_shapes, count_weighted_ratio
from lightning_opkit.core.torch_compat import events_with_dtypes

__all__ = ["gemm_speed"]

#: the window's costliest distinct shapes timed
_MOST = 3
_GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _operands(op: str, shapes: list[list[int]], device: torch.device) -> list[torch.Tensor] | None:
    tensors = [s for s in shapes if isinstance(s, list) and s and all(isinstance(d, int) for d in s)]
    need = 2 if op in ("aten::mm", "aten::bmm") else 3
    if len(tensors) < need:
        return None
    return [torch.randn(*s, device=device) for s in tensors[:need]]


def _call(op: str, operands: list[torch.Tensor], dtype: torch.dtype) -> Callable[[], Any]:
    ops: dict[str, Callable[..., torch.Tensor]] = {"aten::mm": torch.mm, "aten::bmm": torch.bmm,
                                                   "aten::addmm": torch.addmm, "aten::baddbmm": torch.baddbmm}
    fn = ops[op]
    if dtype == torch.float32:
        return lambda: fn(*operands)
    return lambda: fn(*(t.to(dtype) for t in operands))  # the casts a policy would add are part of the price


def _seconds(op: str, shapes: list[list[int]], device: torch.device, dtype: str) -> tuple[float, float] | None:
    """``(fp32, dtype)`` seconds per call of the GEMM at these shapes, side by side (core/timing's one timer)."""
    operands = _operands(op, shapes, device)
    if operands is None:
        return None
    times = at_shapes(("gemm", op, str(shapes)), {"fp32": _call(op, operands, torch.float32),
                                                  dtype: _call(op, operands, BY_NAME[dtype])}, device, fill_s=2e-3)
    return times["fp32"], times[dtype]


def _words(op: str, shapes: list[list[int]]) -> str:
    """``"64x32@32x96"``: the GEMM's two operands (addmm's first input is its bias)."""
    first = 0 if op in ("aten::mm", "aten::bmm") else 1
    return "@".join("x".join(map(str, s)) for s in shapes[first:first + 2])


def gemm_speed(prof: Any, device: torch.device | str, window: int, use_device: bool = False,
               dtype: str = "bf16") -> SpeedFact | None:
    """bf16 time over fp32 time of the window's costliest fp32 GEMMs, weighted by their recorded time and count.

    Args:
        prof: a stopped profiler run with ``record_shapes=True``.
        device: the training device, where they are timed.
        window: the window's number, for the fact's source.
        use_device: weigh by device self time (a GPU window).
        dtype: the 16-bit dtype.

    Returns:
        The measurement, or ``None`` when the window ran no fp32 GEMM with recorded shapes.
    """
    device = torch.device(device)
    spent: dict[tuple[str, str], list[Any]] = {}
    for e in events_with_dtypes(prof):
        if e.key not in _GEMMS or not e.input_shapes:
            continue
        dtypes = list(getattr(e, "input_dtypes", None) or [])
        if not dtypes or PROFILER_DTYPES.get(dtypes[0]) != "fp32":
            continue
        entry = spent.setdefault((e.key, str(e.input_shapes)), [e.key, list(e.input_shapes), 0.0, 0])
        entry[2] += float(e.self_device_time_total if use_device else e.self_cpu_time_total)
        entry[3] += 1
    costliest = sorted(spent.values(), key=lambda v: -v[2])[:_MOST]
    found = count_weighted_ratio((count, _seconds(op, shapes, device, dtype), _words(op, shapes))
                                 for op, shapes, _, count in costliest)
    if found is None:
        return None
    ratio, timed = found
    return SpeedFact("matmul", dtype, ratio,
                     f"this model's {len(timed)} costliest GEMM shapes ({', '.join(timed)}), as the window recorded"
                     " them, input casts included", f"measured by the roofline in window {window}")
