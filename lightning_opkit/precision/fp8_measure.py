"""``rules="auto"`` and float8: each GEMM module measured alone, and run in float8 where that pays and stays accurate.

Per module, not per class: a wide MLP projection and a narrow router (``Linear(4096, 8)``) sit in the same class, and
torchao's own issue #2262 shows one narrow layer undoing a whole step's float8 gain. For each ``nn.Linear`` (and Hugging
Face ``Conv1D``) the measurement:

1. records how many rows each call of the module multiplies, on the measured step (scaled to the full batch);
2. times its GEMM forward + backward at those shapes in its class's dtype and in float8 (torchao's matmul, its scaling
   included), interleaved (A B B A ...), identical modules once;
3. for those at least :data:`~lightning_opkit.core.facts.FASTER` times faster in float8, runs the step with that module
   alone in float8 (the rest in fp32): the loss change and the gradients' cosine against fp32, held to the policy's
   ``tolerance`` like a class lowered to bf16;
4. runs the step with every chosen module in float8 at once, and drops the worst alone-error first while that misses.

Timed eagerly: where TorchCompile is attached, torchao's scaling fuses into fewer kernels, so the eager figures
understate float8's gain (a conservative choice, never a generous one).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_opkit.core.dtypes import autocast_off
from lightning_opkit.core.facts import CLEARLY_SLOWER, FASTER
from lightning_opkit.core.logging import markdown_table
from lightning_opkit.core.suspend import SUSPENDED
from lightning_opkit.core.text import describe_error, times_phrase
from lightning_opkit.core.timing import at_shapes
from lightning_opkit.precision.decide import Decision
from lightning_opkit.precision.dtypes import DTYPES
from lightning_opkit.precision.fp8 import FP8, Float8Linears, gemm_dims, gemm_function, recipe_problem, refusal
from lightning_opkit.precision.runner import StepRunner, grad_cosine, loss_change, step_error

__all__ = ["Fp8Ask", "Fp8Measurements", "Fp8Row", "measure_fp8"]

#: timed calls per arm (the median decides)
REPS = 5
# float8 CLEARLY_SLOWER times slower than the class's dtype after one call is not timed further (a CPU's reference
# GEMM)
#: the chosen modules missing the tolerance together: the worst alone is dropped, at most this many times, then all
_MAX_DROPS = 4


@dataclass(frozen=True)
class Fp8Ask:
    """What ``rules="auto"`` is to measure in float8: the candidate modules and the recipe, or why none.

    Args:
        modules: ``(path, module)`` candidates (empty: none tried).
        recipe: torchao's scaling recipe.
        note: why none is tried (``""`` when some are).
    """

    modules: Sequence[tuple[str, nn.Module]] = ()
    recipe: str = "tensorwise"
    note: str = ""


@dataclass(frozen=True)
class Fp8Row:
    """One GEMM module measured for float8: its shapes, its times, its error, and the verdict.

    Args:
        module: the module's path.
        dims: ``(in, out)`` features.
        tokens: the rows each call multiplied, scaled to the full batch (empty: not called in the step).
        base: the dtype its class runs in otherwise (what float8 must beat).
        base_ms: forward + backward of its GEMMs in ``base`` (median, ms).
        fp8_ms: the same in float8.
        loss_change: the step's relative loss change with this module alone in float8.
        grad_cosine: the gradients' cosine against fp32 likewise.
        verdict: why it stays in ``base`` (``None``: it runs in float8).
    """

    module: str
    dims: tuple[int, int]
    tokens: tuple[int, ...] = ()
    base: str = "bf16"
    base_ms: float | None = None
    fp8_ms: float | None = None
    loss_change: float | None = None
    grad_cosine: float | None = None
    verdict: str | None = "not measured"

    @property
    def chosen(self) -> bool:
        """Whether the module runs in float8."""
        return self.verdict is None

    @property
    def time_ratio(self) -> float | None:
        """float8's time over ``base``'s (below 1: faster)."""
        if self.base_ms is None or self.fp8_ms is None:
            return None
        return self.fp8_ms / max(self.base_ms, 1e-12)

    @property
    def error(self) -> float:
        """How far from the reference step as one number (:func:`~lightning_opkit.precision.runner.step_error`)."""
        return step_error(self.loss_change, self.grad_cosine)

    def why(self) -> str:
        """The evidence in words: ``"1.62x faster than bf16, loss change 2.1e-04, grad cosine 0.99981"``."""
        ratio = self.time_ratio
        text = "-" if ratio is None else f"{times_phrase(ratio)} than {self.base}"
        if self.loss_change is not None:
            cos = "-" if self.grad_cosine is None else f"{self.grad_cosine:.5f}"
            text += f", loss change {self.loss_change:.2e}, grad cosine {cos}"
        return text


@dataclass(frozen=True)
class Fp8Measurements:
    """Every GEMM module's float8 measurement, and the chosen ones' error together.

    Args:
        rows: one per GEMM module, in model order.
        recipe: torchao's scaling recipe measured.
        tolerance: the tolerance held to.
        seconds: what measuring cost, wall clock.
        together: the loss change and gradient cosine with every chosen module in float8 at once.
    """

    rows: tuple[Fp8Row, ...]
    recipe: str
    tolerance: float
    seconds: float = 0.0
    together: tuple[float, float | None] | None = None

    @property
    def chosen(self) -> dict[str, Decision]:
        """The modules that run in float8 -> the decision, its evidence in words."""
        return {r.module: Decision("matmul", FP8, r.why()) for r in self.rows if r.chosen}

    def markdown(self) -> str:
        """``opkit/precision/fp8``: each module's shapes, times, error and verdict."""
        body = [[r.module, f"{r.dims[0]}x{r.dims[1]}", ", ".join(map(str, r.tokens[:3])) or "-",
                 _ms(r.base_ms), _ms(r.fp8_ms), "-" if r.time_ratio is None else times_phrase(r.time_ratio),
                 "-" if r.loss_change is None else f"{r.loss_change:.2e}",
                 "-" if r.grad_cosine is None else f"{r.grad_cosine:.5f}",
                 "fp8" if r.chosen else f"{r.base}: {r.verdict}"] for r in self.rows]
        together = ""
        if self.together is not None:
            cos = "-" if self.together[1] is None else f"{self.together[1]:.5f}"
            together = f" Together: loss change {self.together[0]:.2e}, grad cosine {cos}."
        head = (f"float8 per GEMM module ({self.recipe} scaling, torchao), measured in {self.seconds:.2f} s:"
                f" forward + backward of each module's GEMMs at this run's rows, eager, against its class's dtype;"
                f" error with the module alone in float8, tolerance {self.tolerance:g}.{together}\n\n")
        return head + markdown_table(["module", "in x out", "rows", "base ms", "fp8 ms", "fp8 vs base",
                                      "loss change", "grad cosine", "runs in"], body)

    def lines(self) -> list[str]:
        """The run summary's lines: how many run in float8, and why the others do not (a few named)."""
        chosen = [r for r in self.rows if r.chosen]
        # what could not run in float8 (a shape, the device) before what was measured not to pay
        left = sorted((r for r in self.rows if not r.chosen), key=lambda r: r.time_ratio is not None)
        out = [f"  fp8 (auto, measured in {self.seconds:.1f} s): {len(chosen)} of {len(self.rows)} GEMM module(s)"
               f" in float8" + (f", e.g. {chosen[0].module} ({chosen[0].why()})" if chosen else "")]
        if left:
            named = "; ".join(f"{r.module} ({r.verdict})" for r in left[:3])
            out.append(f"  fp8 (auto): kept in {left[0].base}: {named}" + (
                f"; and {len(left) - 3} more" if len(left) > 3 else ""))
        return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _timed_pair(dims: tuple[int, int], bias: bool, tokens: Sequence[int], base: str, recipe: str,
                device: torch.device, reps: int) -> tuple[float, float]:
    """The median forward + backward of GEMMs at ``tokens`` rows in ``base`` and in float8 (seconds), side by side."""
    gen = torch.Generator(device=device).manual_seed(0)  # its own stream: the run's RNG does not move
    low = DTYPES[base] or torch.float32
    weight = (torch.randn(dims[1], dims[0], device=device, generator=gen) * dims[0] ** -0.5).requires_grad_()
    b = torch.zeros(dims[1], device=device, requires_grad=True) if bias else None
    xs = [torch.randn(m, dims[0], device=device, generator=gen).to(low).requires_grad_() for m in tokens]
    gs = [torch.randn(m, dims[1], device=device, generator=gen).to(low) for m in tokens]
    mm, config, mm_config = gemm_function(recipe)

    def plain() -> None:  # as autocast runs it: the weight cast to the activation's dtype on each call
        for x, g in zip(xs, gs):
            out = F.linear(x, weight.to(low), None if b is None else b.to(low))
            torch.autograd.grad(out, (x, weight), g)

    def fp8() -> None:
        for x, g in zip(xs, gs):
            out = mm.apply(x, weight.t(), mm_config, config)
            if b is not None:
                out = out + b.to(out.dtype)
            torch.autograd.grad(out, (x, weight), g.to(out.dtype))

    # core/timing's one timer: a warm-up call each (first-shape allocations, torchao's lazy imports), then rounds in
    # turn; float8 clearly slower after one sample is not sampled again
    with SUSPENDED.scope(), autocast_off():
        times = at_shapes(("fp8 linear", dims, bias, tuple(tokens), recipe), {base: plain, FP8: fp8}, device,
                          reps=reps, give_up=CLEARLY_SLOWER)
    return times[base], times[FP8]


def _tokens(runner: StepRunner, modules: Sequence[tuple[str, nn.Module]]) -> tuple[Tensor, list[Tensor | None],
                                                                                   dict[str, list[int]]]:
    """The fp32 run of the step, and the rows each call of each module multiplied in it."""
    calls: dict[str, list[int]] = {name: [] for name, _ in modules}
    handles = []
    for name, module in modules:
        width = gemm_dims(module)[0]  # type: ignore[index]

        def count(_: nn.Module, args: tuple[Any, ...], name: str = name, width: int = width) -> None:
            if args and isinstance(args[0], Tensor):
                calls[name].append(args[0].numel() // width)

        handles.append(module.register_forward_pre_hook(count))
    try:
        loss, grads = runner.run()
    finally:
        for handle in handles:
            handle.remove()
    return loss, grads, calls


def _alone(runner: StepRunner, recipe: str, modules: Sequence[tuple[str, nn.Module]],
           device: torch.device) -> tuple[Tensor, list[Tensor | None]]:
    """The step with ``modules`` in float8 and everything else in fp32."""
    fp8 = Float8Linears(recipe, census=lambda: None)  # type: ignore[arg-type]
    fp8.convert(list(modules), device)
    try:
        return runner.run()
    finally:
        fp8.restore()


def measure_fp8(
    runner: StepRunner,
    modules: Sequence[tuple[str, nn.Module]],
    device: torch.device,
    recipe: str = "tensorwise",
    base: str = "bf16",
    tolerance: float = 0.01,
    min_speedup: float = FASTER,
    scale: float = 1.0,
    reps: int = REPS,
    agree: Callable[[Any], Any] = lambda value: value,
) -> Fp8Measurements:
    """Measure each GEMM module of ``modules`` in float8 and choose those that are faster and accurate enough.

    Call it inside ``runner.session()``. Every rank runs the same steps: the speed verdicts and the final choice are
    rank zero's (``agree``).

    Args:
        runner: runs the step on the measured batch.
        modules: ``(path, module)`` candidates (not GEMM modules are left out).
        device: where they run.
        recipe: torchao's scaling recipe.
        base: the dtype the modules' class runs in otherwise.
        tolerance: the largest loss change and ``1 - grad cosine`` one module alone, and all together, may cause.
        min_speedup: how much faster than ``base`` float8 must be.
        scale: full batch rows over measured rows (the GEMMs are timed at the full batch's rows).
        reps: timed calls per arm.
        agree: rank zero's value on every rank.

    Example:
        >>> from lightning_opkit.precision.runner import StepRunner
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
        >>> runner = StepRunner(model, torch.ones(16, 32), lambda m, b: m(b).square().mean())
        >>> with runner.session():  # min_speedup=0: speed decides nothing (a CPU's float8 GEMM is a slow reference)
        ...     found = measure_fp8(runner, list(model.named_modules()), torch.device("cpu"), tolerance=0.05,
        ...                         min_speedup=0.0)
        >>> [(r.module, r.chosen) for r in found.rows]
        [('0', True), ('2', False)]
        >>> found.rows[1].verdict
        '32x8: float8 GEMMs need dimensions that are multiples of 16'
    """
    began = time.perf_counter()
    rows = [Fp8Row(name, dims) for name, m in modules if (dims := gemm_dims(m)) is not None]
    by_name = dict(modules)
    problem = recipe_problem(recipe, device.type)
    ref_loss, ref_grads, calls = _tokens(runner, [(r.module, by_name[r.module]) for r in rows])
    timed: dict[tuple[Any, ...], tuple[float, float] | str] = {}
    for i, row in enumerate(rows):
        module = by_name[row.module]
        tokens = tuple(max(1, round(m * scale)) for m in calls[row.module])
        row = rows[i] = dataclasses.replace(row, tokens=tokens, base=base)
        why = refusal(module, device) or problem or (None if tokens else "not called in the measured step")
        if why is not None:
            rows[i] = dataclasses.replace(row, verdict=why)
            continue
        key = (row.dims, getattr(module, "bias", None) is not None, tokens)
        if key not in timed:
            try:
                timed[key] = _timed_pair(row.dims, key[1], tokens, base, recipe, device, reps)
            except Exception as err:  # a shape this torch's float8 GEMM refuses
                timed[key] = f"float8 GEMM failed ({describe_error(err, 100)})"
        got = timed[key]
        if isinstance(got, str):
            rows[i] = dataclasses.replace(row, verdict=got)
            continue
        row = dataclasses.replace(row, base_ms=1e3 * got[0], fp8_ms=1e3 * got[1])
        slow = row.fp8_ms * min_speedup > row.base_ms  # type: ignore[operator]
        rows[i] = dataclasses.replace(row, verdict=f"{times_phrase(row.time_ratio)} than {base}; needs"  # type: ignore[arg-type]
                                      f" {min_speedup:.2f}x faster" if slow else None)
    rows = list(agree(rows))
    for i, row in enumerate(rows):
        if row.chosen:
            loss, grads = _alone(runner, recipe, [(row.module, by_name[row.module])], device)
            row = dataclasses.replace(row, loss_change=loss_change(loss, ref_loss),
                                      grad_cosine=grad_cosine(grads, ref_grads))
            rows[i] = row if row.error <= tolerance else dataclasses.replace(
                row, verdict=f"error {row.error:.2e} > tolerance {tolerance:g}")
    rows = list(agree(rows))
    together = _together(runner, recipe, rows, by_name, device, tolerance, ref_loss, ref_grads)
    rows, together = agree((rows, together))
    return Fp8Measurements(tuple(rows), recipe, tolerance, time.perf_counter() - began, together)


def _together(runner: StepRunner, recipe: str, rows: list[Fp8Row], by_name: dict[str, nn.Module],
              device: torch.device, tolerance: float, ref_loss: Tensor,
              ref_grads: list[Tensor | None]) -> tuple[float, float | None] | None:
    """Every chosen module in float8 at once; while that misses ``tolerance``, the worst alone is dropped (in place)."""
    for drops in range(_MAX_DROPS + 1):
        chosen = [r for r in rows if r.chosen]
        if len(chosen) < 2:
            return None
        loss, grads = _alone(runner, recipe, [(r.module, by_name[r.module]) for r in chosen], device)
        change, cosine = loss_change(loss, ref_loss), grad_cosine(grads, ref_grads)
        error = max(change, 0.0 if cosine is None else 1.0 - cosine)
        if error <= tolerance:
            return change, cosine
        if drops == _MAX_DROPS:
            break
        worst = max(chosen, key=lambda r: r.error)
        rows[rows.index(worst)] = dataclasses.replace(
            worst, verdict=f"within tolerance alone, not with the others (together: error {error:.2e})")
    for i, row in enumerate(rows):
        if row.chosen:
            rows[i] = dataclasses.replace(row, verdict=f"the chosen modules together miss tolerance {tolerance:g}")
    return None
