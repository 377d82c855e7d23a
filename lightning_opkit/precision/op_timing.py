"""Each op class timed in fp32 and 16-bit at the shapes a step ran, forward + backward, on the device's clock.

No model run: the ops an :class:`~.oplog.OpLog` recorded are replayed alone, each with its input casts, as many calls
back to back as fill a sample (on CUDA between two events, so the figure is the kernels' time, not the launch
latency of one op between two synchronizations), interleaved across dtypes so drift hits them alike.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_opkit.core.dtypes import autocast_off
from lightning_opkit.core.facts import CLEARLY_SLOWER
from lightning_opkit.core.text import describe_error
from lightning_opkit.core.timing import at_shapes
from lightning_opkit.core.torch_compat import tree_leaves, tree_map
from lightning_opkit.opclass import OP_CLASSES
from lightning_opkit.precision.dtypes import DTYPES
from lightning_opkit.precision.oplog import OpLog, Stat
from lightning_opkit.precision.results import Measurement

__all__ = ["time_classes"]

#: of each class, time the costliest op shapes that make up this share of its fp32 time (at most _MAX_SHAPES)
_COVER = 0.9
_MAX_SHAPES = 3
# a dtype CLEARLY_SLOWER times slower than fp32 after one repetition is not timed further
#: each timing sample lasts about this long (fast ops: several calls per sample)
_SAMPLE_S = 1e-3



class _OpTimer:
    """One op at one input shape, timed forward + backward with its floating inputs cast to a dtype first."""

    def __init__(self, func: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device) -> None:
        self.func, self.device = func, device
        self.leaves: list[Tensor] = []

        def leaf(t: Any) -> Any:
            if isinstance(t, Stat):
                return t.as_subclass(Tensor)
            if isinstance(t, Tensor) and t.is_floating_point():
                t = t.detach().requires_grad_(True)
                self.leaves.append(t)
            return t

        self.args, self.kwargs = tree_map(leaf, (args, kwargs))
        self.grads: dict[torch.dtype, list[Tensor]] = {}

    def call(self, dtype: torch.dtype) -> None:
        """One forward + backward in ``dtype``, input casts included (queued: no synchronization)."""
        a, k = tree_map(lambda t: t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t,
                        (self.args, self.kwargs))
        outs = [o for o in tree_leaves(self.func(*a, **k)) if isinstance(o, Tensor) and o.requires_grad]
        if outs:
            grads = self.grads.setdefault(dtype, [torch.ones_like(o) for o in outs])
            torch.autograd.grad(outs, self.leaves, grads, allow_unused=True)


def _timed(device: torch.device, key: tuple[Any, ...], example: tuple, dtypes: list[torch.dtype],
           reps: int) -> dict[torch.dtype, float]:
    """Median seconds per dtype (``dtypes[0]`` is fp32), forward + backward with the input casts (core/timing).

    A dtype that fails raises; one clearly slower than fp32 after its first sample is not sampled again.
    """
    _, func, args, kwargs = example
    timer = _OpTimer(func, args, kwargs, device)
    with autocast_off(), torch.enable_grad():
        times = at_shapes(("op", *key), {str(d): functools.partial(timer.call, d) for d in dtypes}, device, reps=reps,
                          fill_s=_SAMPLE_S, give_up=CLEARLY_SLOWER)
    return {d: times[str(d)] for d in dtypes}


def _pick_shapes(log: OpLog, keys: list[tuple[Any, ...]], base: dict[tuple[Any, ...], float]) -> list[tuple]:
    """Of one class's op shapes, the costliest that make up ``_COVER`` of its fp32 time (at most ``_MAX_SHAPES``)."""
    weight = {k: base[k] * log.counts[k] for k in keys}
    total = sum(weight.values())
    chosen: list[tuple[Any, ...]] = []
    for k in sorted(keys, key=weight.__getitem__, reverse=True):
        if len(chosen) == _MAX_SHAPES or sum(weight[c] for c in chosen) >= _COVER * total:
            break
        chosen.append(k)
    return chosen


def time_classes(log: OpLog, device: torch.device, names: Sequence[str], classes: Sequence[str] | None = None,
                 reps: int = 5, notes: list[str] | None = None) -> list[Measurement]:
    """Speed of each recorded class in each dtype of ``names`` against fp32, at the recorded shapes (no model run).

    Args:
        log: the ops a step ran (:func:`record_ops`, or an ``OpLog`` entered around a real step).
        device: where to time.
        names: the 16-bit dtype names.
        classes: the classes to time; ``None`` = every class in the log.
        reps: timed repetitions per op shape (the median is kept).
        notes: where to say which ops could not be timed.
    """
    notes = notes if notes is not None else []
    by_class: dict[str, list[tuple[Any, ...]]] = {}
    for key, (cls, *_) in log.examples.items():
        if classes is None or cls in classes:
            by_class.setdefault(cls, []).append(key)
    rows: list[Measurement] = []
    for cls in sorted(by_class, key=OP_CLASSES.index):
        base = {}
        for k in by_class[cls]:
            try:  # a quick fp32 estimate per shape, to find where the class's time goes
                base[k] = _timed(device, k, log.examples[k], [torch.float32], 1)[torch.float32]
            except Exception as err:  # an op that cannot be run alone (unusual arguments): left out of timing
                notes.append(f"{cls}: {getattr(k[0], '__name__', k[0])} not timed ({type(err).__name__})")
        keys = list(base)
        if not keys:
            continue
        total = sum(base[k] * log.counts[k] for k in keys)
        chosen = _pick_shapes(log, keys, base)
        calls = sum(log.counts[k] for k in keys)
        for name in names:
            row = Measurement(cls, name, fp32_ms=total * 1e3, calls=calls)
            rows.append(row)
            dtype = DTYPES[name]
            assert dtype is not None
            try:
                pairs = [_timed(device, k, log.examples[k], [torch.float32, dtype], reps) for k in chosen]
            except Exception as err:  # the op has no kernel for this dtype on this device
                row.failed = describe_error(err, 120)
                continue
            fp32_time = sum(t[torch.float32] * log.counts[k] for t, k in zip(pairs, chosen))
            row.time_ratio = sum(t[dtype] * log.counts[k] for t, k in zip(pairs, chosen)) / max(fp32_time, 1e-12)
    return rows
