"""channels_last against contiguous at this model's own convolutions, forward and backward: the conv layout's evidence.

Whether a layout pays depends on the device, its library (oneDNN, cuDNN) and the shapes: on CPUs a blocked,
SIMD-friendly layout can be several times faster for convolution, and for a depthwise or 1x1 conv it can be slower.
So nothing is assumed: the window's costliest distinct convolutions (shape, stride, padding, groups, dtype, as the
profiler recorded them) are timed forward and backward in both layouts, back to back on the device's clock, and the
result is kept for the run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_opkit.core.dtypes import BY_NAME, PROFILER_DTYPES
from lightning_opkit.core.facts import SpeedFact
from lightning_opkit.core.timing import at_shapes, count_weighted_ratio
from lightning_opkit.core.torch_compat import events_with_dtypes

__all__ = ["conv_layout", "conv_layout_speed"]

#: the window's costliest distinct convolutions timed
_MOST = 3
_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}
_CONVS = (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def conv_layout(model: nn.Module) -> str:
    """``"channels_last"`` when the model's 2d/3d convolution weights are in that layout, else ``"contiguous"``.

    Example:
        >>> conv = nn.Conv2d(3, 8, 3)
        >>> conv_layout(conv), conv_layout(conv.to(memory_format=torch.channels_last))
        ('contiguous', 'channels_last')
    """
    for m in model.modules():
        w = getattr(m, "weight", None)
        # a 1x1 kernel's weight is contiguous in both layouts: it tells nothing
        if isinstance(m, _CONVS) and isinstance(w, torch.Tensor) and not w.is_contiguous():
            return "channels_last" if w.is_contiguous(memory_format=_FORMATS[w.dim()]) else "contiguous"
    return "contiguous"


def _recorded(prof: Any, use_device: bool) -> list[list[Any]]:
    """``[shapes, arguments, dtype, count, time]`` per distinct 2d/3d convolution of the window, costliest first.

    Time is the ``aten::convolution`` op's total, its kernels included.
    """
    spent: dict[str, list[Any]] = {}
    for e in events_with_dtypes(prof):
        shapes = e.input_shapes
        if e.key != "aten::convolution" or not shapes or len(shapes[0]) not in _FORMATS:
            continue
        arguments = list(getattr(e, "concrete_inputs", None) or [])[3:9]
        dtype = PROFILER_DTYPES.get((list(getattr(e, "input_dtypes", None) or []) or [""])[0])
        if len(arguments) != 6 or dtype is None:
            continue
        key = f"{shapes[:3]}{arguments}{dtype}"
        entry = spent.setdefault(key, [shapes[:3], arguments, dtype, 0, 0.0])
        entry[3] += 1
        entry[4] += float(e.device_time_total if use_device else e.cpu_time_total)
    return sorted(spent.values(), key=lambda v: -v[4])


def _step(shapes: list[list[int]], arguments: list[Any], dtype: torch.dtype, device: torch.device,
          channels_last: bool) -> Callable[[], Any]:
    """One convolution forward and backward (gradients of its input, weight and bias) in one layout."""
    x, w = (torch.randn(*s, device=device, dtype=dtype) for s in shapes[:2])
    b = torch.randn(*shapes[2], device=device, dtype=dtype) if shapes[2] else None
    if channels_last:
        x, w = (t.contiguous(memory_format=_FORMATS[t.dim()]) for t in (x, w))
    inputs = [t.requires_grad_() for t in (x, w, b) if t is not None]
    stride, padding, dilation, transposed, output_padding, groups = arguments
    with torch.no_grad():
        out = torch.convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)
        # the same values in both layouts (randn_like would fill memory order), in the layout the output has
        grad = torch.empty_like(out).copy_(torch.randn(out.shape, device=device, dtype=dtype))

    def run() -> Any:
        out = torch.convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)
        return torch.autograd.grad(out, inputs, grad)

    return run


def _seconds(shapes: list[list[int]], arguments: list[Any], dtype: str,
             device: torch.device) -> tuple[float, float] | None:
    """``(contiguous, channels_last)`` seconds per forward + backward of the convolution, side by side."""
    try:
        times = at_shapes(("conv", str(shapes), str(arguments), dtype), {
            "contiguous": _step(shapes, arguments, BY_NAME[dtype], device, False),
            "channels_last": _step(shapes, arguments, BY_NAME[dtype], device, True)}, device, fill_s=2e-3)
    except (RuntimeError, TypeError, ValueError, KeyError):
        # arguments the profiler recorded in another form, a layout this device's library refuses, or no memory
        # left beside the model: no fact, and the roofline goes on without it
        return None
    return times["contiguous"], times["channels_last"]


def _words(shapes: list[list[int]], arguments: list[Any]) -> str:
    """``"8x64x32x32*128x64x3x3/s2"``: input, weight, and a stride or groups other than 1."""
    text = "*".join("x".join(map(str, s)) for s in shapes[:2])
    stride, groups = arguments[0], arguments[5]
    return text + (f"/s{stride[0]}" if any(s != 1 for s in stride) else "") + (f"/g{groups}" if groups != 1 else "")


def conv_layout_speed(prof: Any, device: torch.device | str, window: int, current: str = "contiguous",
                      use_device: bool = False) -> SpeedFact | None:
    """channels_last time over contiguous time of the window's costliest convolutions, weighted by their counts.

    Args:
        prof: a stopped profiler run with ``record_shapes=True``.
        device: the training device, where they are timed.
        window: the window's number, for the fact's source.
        current: the layout the model runs in (:func:`conv_layout`).
        use_device: rank the convolutions by device time (a GPU window).

    Returns:
        The measurement, or ``None`` when the window ran no 2d/3d convolution with recorded shapes.
    """
    device = torch.device(device)
    found = count_weighted_ratio((count, _seconds(shapes, arguments, dtype, device), _words(shapes, arguments))
                                 for shapes, arguments, dtype, count, _ in _recorded(prof, use_device)[:_MOST])
    if found is None:
        return None
    ratio, timed = found
    return SpeedFact("conv", "channels_last", ratio,
                     f"this model's {len(timed)} costliest conv shapes ({', '.join(timed)})" if len(timed) > 1 else
                     f"this model's costliest conv shape ({timed[0]})",
                     f"measured by the roofline in window {window}", baseline="contiguous", current=current,
                     passes="forward and backward")
