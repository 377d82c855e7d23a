"""Measure, on this device and this model, how fast and how accurate each op class is in each 16-bit dtype.

Speed: the ops the model ran on a real batch, at their shapes, timed forward + backward in fp32 and in each 16-bit
dtype (with the input casts the policy would add), weighted by how often the model calls them. Error: the step run
again with one class alone lowered to one dtype (everything else fp32): that class's outputs against fp32 recomputes
of the same ops, the loss against the fp32 loss, the gradients against the fp32 gradients.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from lightning_opkit.core.logging import markdown_table
from lightning_opkit.core.patch import Patches
from lightning_opkit.core.ranks import local
from lightning_opkit.core.replay import REPLAYING, autocast_off, loss_of, preserved, quiet_logging, run_step
from lightning_opkit.opclass import OP_CLASSES
from lightning_opkit.precision.census import UPDATED_ARGS, Census
from lightning_opkit.precision.dtypes import DTYPES, GOVERNED, NEVER_CAST, describe_device
from lightning_opkit.precision.function_mode import ModeState, PolicyMode, hold_rnn_input_casts, policy_info

__all__ = ["Measurement", "PrecisionMeasurements", "measure_precision"]

#: of each class, time the costliest op shapes that make up this share of its fp32 time (at most _MAX_SHAPES)
_COVER = 0.9
_MAX_SHAPES = 3
#: a dtype this many times slower than fp32 after one repetition is not timed further
_CLEARLY_SLOWER = 3.0

#: each timing sample lasts at least this long (fast ops: several calls per sample, at most _MAX_INNER)
_SAMPLE_S = 1e-3
_MAX_INNER = 20

# (device, op, input shapes and dtypes, dtypes timed) -> dtype -> seconds for one forward + backward; a model's
# shapes rarely change within a run, so a re-measurement times nothing again
_TIMES: dict[tuple[Any, ...], dict[torch.dtype, float]] = {}


@dataclass
class Measurement:
    """One class in one dtype: speed against fp32 and the error of running that class alone in that dtype.

    Args:
        op_class: the op class.
        dtype: ``"bf16"`` or ``"fp16"``.
        speed: time in ``dtype`` / time in fp32, forward + backward with input casts (below 1 = faster);
            ``None`` if not measured.
        rel_error: ``||out - ref|| / ||ref||`` of the class's outputs against fp32 recomputes of the same ops.
        loss_change: ``|loss - loss_fp32| / |loss_fp32|`` with this class alone in ``dtype``.
        grad_cosine: cosine similarity of all parameter gradients to the fp32 gradients.
        fp32_ms: the class's measured fp32 time per step (forward + backward), for weighting.
        calls: the class's ops per forward.
        failed: why the class could not run in ``dtype``, if it could not.
    """

    op_class: str
    dtype: str
    speed: float | None = None
    rel_error: float | None = None
    loss_change: float | None = None
    grad_cosine: float | None = None
    fp32_ms: float | None = None
    calls: int = 0
    failed: str | None = None


@dataclass
class PrecisionMeasurements:
    """The sensitivity table of one model on one device: a :class:`Measurement` per (op class, dtype).

    Args:
        rows: the measurements.
        device: a description of the device they were taken on.
        loss: the fp32 loss of the measured batch.
        seconds: what measuring cost, wall clock.
        notes: what could not be measured, and why.
    """

    rows: list[Measurement]
    device: str = ""
    loss: float = math.nan
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Measurement]:
        return iter(self.rows)

    def get(self, op_class: str, dtype: str) -> Measurement | None:
        """The row of ``op_class`` in ``dtype``, if measured."""
        return next((r for r in self.rows if r.op_class == op_class and r.dtype == dtype), None)

    @property
    def classes(self) -> list[str]:
        """The op classes measured, in taxonomy order."""
        return sorted({r.op_class for r in self.rows}, key=OP_CLASSES.index)

    def table(self, chosen: dict[str, str] | None = None) -> str:
        """The sensitivity table as markdown, costliest class first; ``chosen``: op class -> dtype, marked.

        Args:
            chosen: the dtype decided per class, if any.
        """
        rows = sorted(self.rows, key=lambda r: (-(r.fp32_ms or 0.0), r.op_class, r.dtype))
        body = [[r.op_class, r.dtype, r.calls, r.fp32_ms, speed_phrase(r), _fmt(r.rel_error, ".2e"),
                 _fmt(r.loss_change, ".2e"), _fmt(r.grad_cosine, ".6f"),
                 ("yes" if chosen.get(r.op_class) == r.dtype else "no") if chosen is not None else "-"]
                for r in rows]
        text = markdown_table(["op class", "dtype", "ops / step", "fp32 ms / step", "speed vs fp32",
                               "output rel. error", "loss change", "grad cosine", "chosen"], body)
        return f"Measured in {self.seconds:.2f} s on {self.device}.\n\n{text}"

    def __str__(self) -> str:
        return self.table()


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def speed_phrase(row: Measurement) -> str:
    """``"11.2x slower"`` or ``"1.8x faster"`` for a measured row (``"-"`` if not measured)."""
    if row.failed:
        return f"failed: {row.failed}"
    if row.speed is None:
        return "-"
    return f"{1 / row.speed:.2f}x faster" if row.speed < 1 else f"{row.speed:.2f}x slower"


class OpLog(TorchFunctionMode):
    """Records one example call per (op, input shapes) of each governed class, and how often it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.examples: dict[tuple[Any, ...], tuple[str, Callable[..., Any], tuple, dict]] = {}
        self.counts: dict[tuple[Any, ...], int] = {}

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        cls, inplace = policy_info(func)
        if cls not in NEVER_CAST and not inplace and "out" not in kwargs:
            sig = tuple((tuple(t.shape), t.dtype) if isinstance(t, Tensor) else None
                        for t in tree_leaves((args, kwargs)))
            key = (func, sig)
            if key not in self.examples:
                # A DTensor (tensor parallel) by its local shard: timing it alone must run no collective, since
                # each rank repeats an op as often as its own clock asks.
                keep = tree_map(lambda t: local(t).detach() if isinstance(t, Tensor) else t, (args, kwargs))
                if func in UPDATED_ARGS:
                    # Timing must not write into the model's running statistics, nor differentiate them.
                    positions, names = UPDATED_ARGS[func]
                    keep = (tuple(_stat(a) if i in positions else a for i, a in enumerate(keep[0])),
                            {k: _stat(v) if k in names else v for k, v in keep[1].items()})
                self.examples[key] = (cls, func, *keep)
            self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **kwargs)


class _Stat(Tensor):
    """A running statistic: cloned for timing, never a differentiable leaf."""


def _stat(value: Any) -> Any:
    return value.clone().as_subclass(_Stat) if isinstance(value, Tensor) else value


class _OpTimer:
    """One op at one input shape, timed forward + backward with its floating inputs cast to a dtype first."""

    def __init__(self, func: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device) -> None:
        self.func, self.device = func, device
        self.leaves: list[Tensor] = []

        def leaf(t: Any) -> Any:
            if isinstance(t, _Stat):
                return t.as_subclass(Tensor)
            if isinstance(t, Tensor) and t.is_floating_point():
                t = t.detach().requires_grad_(True)
                self.leaves.append(t)
            return t

        self.args, self.kwargs = tree_map(leaf, (args, kwargs))
        self.grads: dict[torch.dtype, list[Tensor]] = {}
        self.inner = 1

    def once(self, dtype: torch.dtype) -> float:
        """Seconds for one forward + backward in ``dtype``, input casts included."""
        self._sync()
        start = time.perf_counter()
        a, k = tree_map(lambda t: t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t,
                        (self.args, self.kwargs))
        outs = [o for o in tree_leaves(self.func(*a, **k)) if isinstance(o, Tensor) and o.requires_grad]
        if outs:
            grads = self.grads.setdefault(dtype, [torch.ones_like(o) for o in outs])
            torch.autograd.grad(outs, self.leaves, grads, allow_unused=True)
        self._sync()
        return time.perf_counter() - start

    def sample(self, dtype: torch.dtype) -> float:
        """Mean seconds over ``inner`` calls (fast ops are timed several calls at a time, above the clock's jitter)."""
        return sum(self.once(dtype) for _ in range(self.inner)) / self.inner

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _time_op(example: tuple, device: torch.device, dtypes: list[torch.dtype], reps: int) -> dict[torch.dtype, float]:
    """Median seconds per dtype (``dtypes[0]`` is fp32), samples interleaved so drift hits every dtype alike.

    A dtype that fails raises; one clearly slower than fp32 after its first sample is not sampled again.
    """
    _, func, args, kwargs = example
    timer = _OpTimer(func, args, kwargs, device)
    samples: dict[torch.dtype, list[float]] = {d: [] for d in dtypes}
    with autocast_off(), torch.enable_grad():
        for d in dtypes:
            timer.once(d)  # warm-up: allocator, kernel selection, lazy init
        timer.inner = max(1, min(_MAX_INNER, int(_SAMPLE_S / max(timer.once(dtypes[0]), 1e-7))))
        for rep in range(reps):
            for d in dtypes:
                if rep and d != dtypes[0] and samples[d][0] > _CLEARLY_SLOWER * samples[dtypes[0]][0]:
                    continue
                samples[d].append(timer.sample(d))
    return {d: statistics.median(v) for d, v in samples.items()}


def _timed(device: torch.device, key: tuple[Any, ...], example: tuple, dtypes: list[torch.dtype],
           reps: int) -> dict[torch.dtype, float]:
    cache_key = (str(device), *key, tuple(dtypes))
    if cache_key not in _TIMES:
        _TIMES[cache_key] = _time_op(example, device, dtypes, reps)
    return _TIMES[cache_key]


def _default_loss(model: nn.Module, batch: Any) -> Tensor:
    if isinstance(model, pl.LightningModule):
        out = model.training_step(batch, 0)
    elif isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (list, tuple)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = loss_of(out)
    if loss is None or loss.numel() != 1:
        raise ValueError(
            f"measure_precision could not find a scalar loss in what {type(model).__name__} returned"
            f" ({type(out).__name__}); pass `loss_fn=lambda model, batch: ...` returning one."
        )
    return loss


def _device_of(model: nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _usable_dtypes(device: torch.device) -> list[str]:
    # fp16 needs loss scaling; opkit offers it where a GradScaler is the norm (CUDA).
    return ["bf16", "fp16"] if device.type == "cuda" else ["bf16"]


FP32_TABLE: dict[str, str] = dict.fromkeys(GOVERNED, "fp32") | dict.fromkeys(NEVER_CAST, "keep")


class StepRunner:
    """Runs a model's loss and gradients on one batch under a class table (or under autocast), leaving no trace.

    Use it inside :meth:`session`, which keeps the model's buffers, metric states and RNG as they were, runs eagerly
    (compiled code is not re-traced for each table) and silences ``LightningModule.log``.

    Args:
        model: the model, on its device.
        batch: the batch, on that device.
        loss_fn: ``(model, batch) -> scalar loss``.
    """

    def __init__(self, model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Tensor]) -> None:
        self.model, self.batch, self.loss_fn = model, batch, loss_fn
        self.state = ModeState(FP32_TABLE)
        self.mode = PolicyMode(self.state)
        self._reset: Callable[[], None] | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Inside, :meth:`run` may be called any number of times; on exit the model is as it was."""
        model = self.model
        hooks = Patches()
        hold_rnn_input_casts(hooks, model)
        quiet = quiet_logging(model) if isinstance(model, pl.LightningModule) else contextlib.nullcontext()
        with contextlib.ExitStack() as cleanup, preserved(model) as reset, torch.compiler.set_stance("force_eager"), \
                quiet, autocast_off(), REPLAYING.scope():
            cleanup.callback(hooks.restore)
            self._reset = reset
            try:
                yield
            finally:
                self._reset = None

    def run(self, table: dict[str, str] | None = None, log: TorchFunctionMode | None = None,
            census: Census | None = None, autocast: torch.dtype | None = None) -> tuple[Tensor, list[Tensor | None]]:
        """The fp32 loss and the gradients of one run; buffers and RNG put back after.

        It runs under ``table`` (``None``: every class fp32), or, with ``autocast``, under plain ``torch.autocast`` in
        that dtype and no policy.

        Args:
            table: op class -> dtype name.
            log: a mode that records the ops (innermost: it sees what the model called, before any cast).
            census: records what ran in which dtype and its error against fp32 recomputes.
            autocast: run under autocast in this dtype instead of a table (what ``bf16-mixed`` does).
        """
        assert self._reset is not None, "StepRunner.run outside session()"
        self._reset()  # the same RNG, buffers and metric states as every other run: only the dtypes differ
        self.state.set_table(FP32_TABLE if table is None else FP32_TABLE | table)
        self.state.census = census

        def loss() -> Tensor:
            if autocast is not None:
                with torch.autocast(_device_of(self.model).type, dtype=autocast):
                    return self.loss_fn(self.model, self.batch)
            with self.mode, log or contextlib.nullcontext():
                return self.loss_fn(self.model, self.batch)

        try:
            value, grads = run_step(self.model, loss)  # a frozen model: no gradients, the loss alone says it
        finally:
            self.state.census = None
            self.state.set_table(FP32_TABLE)
            self._reset()
        assert value is not None
        return value.float(), grads


def record_ops(runner: StepRunner) -> tuple[OpLog, Tensor, list[Tensor | None]]:
    """Run the step once in fp32, recording each governed op's shapes and calls; returns the log and the fp32 run."""
    log = OpLog()
    loss, grads = runner.run(log=log)
    return log, loss, grads


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
                row.failed = _why(err)
                continue
            fp32_time = sum(t[torch.float32] * log.counts[k] for t, k in zip(pairs, chosen))
            row.speed = sum(t[dtype] * log.counts[k] for t, k in zip(pairs, chosen)) / max(fp32_time, 1e-12)
    return rows


def class_errors(runner: StepRunner, row: Measurement, ref_loss: Tensor, ref_grads: list[Tensor | None]) -> None:
    """Fill ``row``'s errors: the step with its class alone in its dtype, against the fp32 run."""
    census = Census()
    try:
        loss, grads = runner.run({row.op_class: row.dtype}, census=census)
    except Exception as err:
        row.failed = _why(err)
        return
    errs = [r.rel_error for r in census.rows()
            if r.op_class == row.op_class and r.dtype == row.dtype and r.rel_error is not None]
    row.rel_error = max(errs) if errs else None
    row.loss_change = loss_change(loss, ref_loss)
    row.grad_cosine = grad_cosine(grads, ref_grads)


def check_arguments(model: nn.Module, device: torch.device | str | None, dtypes: Sequence[str] | None,
                    classes: Sequence[str] | None) -> tuple[torch.device, list[str]]:
    """The device and dtype names to measure with; ``ValueError`` naming what is wrong otherwise."""
    here = _device_of(model)
    device = torch.device(device) if device is not None else here
    if device.type != here.type or (device.index is not None and here.index is not None and device != here):
        raise ValueError(f"measure_precision: the model is on {here}, not on device={device}; move it there first")
    names = list(dtypes) if dtypes is not None else _usable_dtypes(device)
    for name in names:
        if name not in ("bf16", "fp16"):
            raise ValueError(f"measure_precision: `dtypes` may hold 'bf16' and 'fp16', but got {name!r}")
    if classes is not None:
        unknown = [c for c in classes if c not in GOVERNED]
        if unknown:
            raise ValueError(f"measure_precision: unknown op classes {unknown}; valid classes are {list(GOVERNED)}")
    return device, names


def measure_precision(
    model: nn.Module,
    batch_fn: Callable[[], Any],
    device: torch.device | str | None = None,
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
    dtypes: Sequence[str] | None = None,
    classes: Sequence[str] | None = None,
    errors: bool = True,
    reps: int = 5,
) -> PrecisionMeasurements:
    """Measure each op class's speed and error in each 16-bit dtype, on this device and this model.

    The model's weights, buffers, gradients, metric states and the RNG are as before when it returns.

    Args:
        model: the model (a ``LightningModule``: its ``training_step`` gives the loss), on its training device.
        batch_fn: returns one real batch.
        device: where to run; the model must already be there. ``None`` = the device of its parameters.
        loss_fn: ``(model, batch) -> scalar loss``; ``None`` = ``training_step(batch, 0)`` of a LightningModule,
            else the model's output (a tensor, a dict's ``"loss"`` or an output's ``.loss``).
        dtypes: the 16-bit dtypes to measure; ``None`` = bf16, and fp16 on CUDA.
        classes: the op classes to measure; ``None`` = every governed class the model runs.
        errors: also measure errors (one extra forward + backward per class and dtype); speed only if ``False``.
        reps: timed repetitions per op shape (the median is kept).

    Example:
        >>> model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
        >>> table = measure_precision(model, lambda: torch.randn(8, 16), loss_fn=lambda m, b: m(b).square().mean())
        >>> table.classes
        ['matmul', 'norm', 'reduction', 'pointwise']
        >>> 0.99 < table.get("matmul", "bf16").grad_cosine <= 1.0 + 1e-6
        True
    """
    began = time.perf_counter()
    device, names = check_arguments(model, device, dtypes, classes)
    runner = StepRunner(model, move_data_to_device(batch_fn(), device), loss_fn or _default_loss)
    notes: list[str] = []
    with runner.session():
        log, ref_loss, ref_grads = record_ops(runner)
        rows = time_classes(log, device, names, classes, reps, notes)
        if errors:
            for row in rows:
                if row.failed is None:
                    class_errors(runner, row, ref_loss, ref_grads)
    if not rows:
        notes.append("the model ran no op of a governed class")
    return PrecisionMeasurements(rows, describe_device(device), float(ref_loss), time.perf_counter() - began, notes)


def _why(err: Exception) -> str:
    first = (str(err).splitlines() or [""])[0][:120]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def loss_change(loss: Tensor, ref: Tensor) -> float:
    """``|loss - ref| / |ref|`` (``inf`` if either is not finite)."""
    a, b = float(loss), float(ref)
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def grad_cosine(grads: list[Tensor | None], ref: list[Tensor | None]) -> float | None:
    """Cosine similarity of all gradients to ``ref`` as one vector (``None`` without gradients, -1 if not finite)."""
    pairs = [(g.float(), r.float()) for g, r in zip(grads, ref) if g is not None and r is not None]
    if not pairs:
        return None
    dot = sum((g * r).sum() for g, r in pairs)
    norm_g = sum(g.square().sum() for g, _ in pairs)
    norm_r = sum(r.square().sum() for _, r in pairs)
    value = float(dot / (norm_g.sqrt() * norm_r.sqrt()).clamp_min(1e-30))  # type: ignore[union-attr]
    return value if math.isfinite(value) else -1.0
